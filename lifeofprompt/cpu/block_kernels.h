/* Block matrices (GGUF's Q8_0 and Q4_1) times a few rows, shared by block_kernels.c and c_step.c.
 *
 * y[r][o] = sum_i x[r][i] * W[o][i]   for the rows r of x and a range of rows o of a block matrix W
 *
 * W is kept as the planes of block_formats.py: per row, the quants of its blocks side by side
 * (Q8_0: 32 signed bytes a block; Q4_1: 16 bytes a block, byte j holding weight j in its low
 * four bits and weight j + 16 in its high four), and per block an fp16 scale d (and, Q4_1, an
 * fp16 minimum m): the weight is d q (Q8_0) or d q + m (Q4_1).
 *
 * The weights are never written out as floats. A block's bytes are loaded once, turned into
 * floats in registers (a mask and a shift split the nibbles, a conversion makes them floats, one
 * multiply-add applies d and m) and multiplied into every row of a tile of x (up to TILE_ROWS
 * rows, as row_kernels.h tiles rows): the unpacking is paid once per tile, the multiply-adds once
 * per row, as in the fp32 kernel.
 *
 * Two other ways were measured (one thread of the AMD EPYC this was written on, SmolLM2's shapes,
 * a model's worth of each matrix cycled through; benchmarks/cpu_blocks.py times this kernel) and
 * dropped:
 *   - sum_i x_i (d q_i + m) = d sum_i x_i q_i + m sum_i x_i, multiplying x by the integers q and
 *     scaling each block's sum once: as fast for one row, 1.5-2x slower for 4-8 rows (a multiply
 *     and two multiply-adds a row and block, where weights made floats take two multiply-adds);
 *   - llama.cpp's int8 activations (x quantized per block of 32, integer dot products, vpdpbusd)
 *     on the planes as they are: 1.15-1.25x faster for one row, 0.65-0.95x for four. Integer
 *     products now have their own kernel, with x as two int8 digits (accurate) and the blocks re-laid
 *     so that one vpdpbusd serves sixteen rows: integer_kernels.h. This file's floats remain for
 *     block_activations="float" and where no vector path for the integers exists.
 *
 * With AVX-512 the products of 1 to TILE_ROWS rows take loops of their own, written with
 * intrinsics (below, "a few rows of x, AVX-512"): the tile code's generic unpacking kept the
 * format test inside the block loop and spilled its bookkeeping, and was bound by instructions,
 * not reads (Q4_1 at one row: ~11 GB/s a thread against fp32's ~30). Their Q4_1 unpacking is a
 * lookup (vpermps) in a table of the block's sixteen possible weights, the same floats d q + m.
 * Measured on one thread of the AMD EPYC this was written on, a model's worth of SmolLM2's
 * matrices with the LM head: 8.2 -> 4.6 ms at one row, 8.2 -> 5.3 at two, 10.4 -> 7.9 at four,
 * 21.6 -> 19.6 at eight. The tile code remains for taller products and for AVX2 and portable builds.
 *
 * A matrix whose width is not a multiple of 32 has a last block padded with zeros, and Q4_1 turns
 * a zero weight into d q + m, not exactly 0: those columns must meet zeros in x. So x is read in
 * place where its width is whole blocks, and otherwise copied once per product into rows of whole
 * blocks (block_input). The inner loop never checks for a ragged end.
 *
 * The vector types are row_kernels.h's (the target's own width under -march=native: AVX-512, AVX2,
 * or what a portable build gives). Sums run in another order than x @ W.T on the dequantized
 * weights, so results agree with it up to fp32 summation order.
 */
#ifndef LIFEOFPROMPT_CPU_BLOCKS_H
#define LIFEOFPROMPT_CPU_BLOCKS_H

#include <stdint.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "row_kernels.h"

#define BLOCK 32

/* How a weight matrix is stored: the C step reads each layer matrix in its own format. The _X16
 * formats are the same blocks re-laid in groups of 16 rows for integer products (integer_kernels.h). */
enum { FORMAT_F32 = 0, FORMAT_F32_PACKED = 1, FORMAT_Q8_0 = 2, FORMAT_Q4_1 = 3, FORMAT_Q8_0_X16 = 4, FORMAT_Q4_1_X16 = 5 };

/* One matrix [out, n]: fp32 (row-major, or packed as in row_kernels.h) in `data`; or blocks, with the
 * quants in `data` and the fp16 scales (and Q4_1's minimums) [out, blocks] beside them. */
typedef struct {
    int64_t format;
    const void *data;
    const uint16_t *scales, *mins;
} WeightMatrix;

static inline int is_interleaved(const WeightMatrix *w) {
    return w->format == FORMAT_Q8_0_X16 || w->format == FORMAT_Q4_1_X16;
}
static inline int is_blocks(const WeightMatrix *w) {
    return w->format == FORMAT_Q8_0 || w->format == FORMAT_Q4_1 || is_interleaved(w);
}
static inline long blocks_of(long n) { return (n + BLOCK - 1) / BLOCK; }
static inline long quant_row_bytes(int64_t format, long blocks) {
    return blocks * (format == FORMAT_Q4_1 || format == FORMAT_Q4_1_X16 ? 16 : 32);
}

/* Rows [first, ..) of `w` (n columns) as a matrix of their own: every plane offset by `first` rows
 * (for a packed matrix `first` must be a whole panel, which the row-major offset then also is; for
 * a re-laid one a whole group of 16 rows, whose planes then start where `first` rows' would). */
static inline WeightMatrix matrix_rows(const WeightMatrix *w, long first, long n) {
    WeightMatrix view = *w;
    long blocks = blocks_of(n);
    if (is_blocks(w)) {
        view.data = (const uint8_t *)w->data + first * quant_row_bytes(w->format, blocks);
        view.scales = w->scales + first * blocks;
        view.mins = w->mins ? w->mins + first * blocks : 0;
    } else {
        view.data = (const float *)w->data + first * n;
    }
    return view;
}

/* ------------------------------------------------------------------ fp16 scales */

/* IEEE half to float: the CPU's own conversion where it has one (F16C), else by hand (normals,
 * subnormals, inf, NaN). */
static inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
    union { uint32_t u; float f; } out;
    if (exponent == 0x1f) out.u = sign | 0x7f800000 | (mantissa << 13);
    else if (exponent != 0) out.u = sign | ((exponent + 112) << 23) | (mantissa << 13);
    else {
        out.f = (float)mantissa * (1.0f / 16777216.0f);  /* 2^-24: the subnormal step */
        out.u |= sign;
    }
    return out.f;
#endif
}

/* out[i] = half[i] as float for i < n: eight at a time with F16C's vcvtph2ps (GCC 12 turns a loop
 * over _Float16 into one conversion per element). */
static inline void halves_to_floats(const uint16_t *half, float *out, long n) {
    long i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(half + i))));
#endif
    for (; i < n; i++) out[i] = half_to_float(half[i]);
}

/* ------------------------------------------------------------------ x in whole blocks */

/* The rows of x as the kernel reads them: x itself where n is whole blocks, else copied into
 * `room` (m rows of blocks_of(n) * 32 floats) with zeros past n. Sets *stride to the rows' stride. */
static const float *block_input(const float *x, long x_stride, long m, long n, float *room, long *stride) {
    long width = blocks_of(n) * BLOCK;
    if (width == n) {
        *stride = x_stride;
        return x;
    }
    for (long r = 0; r < m; r++) {
        memcpy(room + r * width, x + r * x_stride, sizeof(float) * n);
        memset(room + r * width + n, 0, sizeof(float) * (width - n));
    }
    *stride = width;
    return room;
}

/* ------------------------------------------------------------------ a block in registers */

typedef uint8_t ubyte_vector __attribute__((vector_size(LANES), aligned(1)));
typedef int32_t int32_vector __attribute__((vector_size(LANES * sizeof(int32_t))));

/* LANES bytes as floats, in two conversions: GCC 12 turned a direct byte-to-float conversion into
 * one scalar conversion per byte, while byte-to-int is one vpmovzxbd. */
static inline float_vector ubytes_to_floats(ubyte_vector bytes) {
    return __builtin_convertvector(__builtin_convertvector(bytes, int32_vector), float_vector);
}

/* A block's 32 weights as floats in BLOCK / LANES vectors, in the order of x's columns.
 * Q8_0: sign-extending bytes was again scalar code in GCC 12, so the bytes are flipped into
 * 0..255 (q ^ 128 = q + 128 for a signed byte), zero-extended, and the 128 taken off in float.
 * Q4_1: LANES bytes give the low nibbles of weights c.. and the high nibbles of weights 16 + c..;
 * then one multiply-add per vector applies d and m. */
static inline __attribute__((always_inline)) void block_weights(int64_t format, const uint8_t *q, float d, float m,
                                                                float_vector w[BLOCK / LANES]) {
    if (format == FORMAT_Q8_0) {
        for (int c = 0; c < BLOCK / LANES; c++)
            w[c] = (ubytes_to_floats(*(const ubyte_vector *)(q + c * LANES) ^ 0x80) - 128.0f) * d;
        return;
    }
    for (int c = 0; c < 16 / LANES; c++) {
        ubyte_vector bytes = *(const ubyte_vector *)(q + c * LANES);
        w[c] = ubytes_to_floats(bytes & 15) * d + m;
        w[c + 16 / LANES] = ubytes_to_floats(bytes >> 4) * d + m;
    }
}

/* ------------------------------------------------------------------ one weight row against a tile of x */

/* Accumulators per row of x. Each block adds to its row's accumulator with a multiply-add that
 * waits ~4 cycles for the one before: with one row that wait, not the work, set the pace. So a
 * tile of 1 row adds its blocks into 4 accumulators in turn, of 2-4 rows into 2; taller tiles
 * have independent rows enough. */
#define CHAINS(rows) ((rows) == 1 ? 4 : (rows) <= 4 ? 2 : 1)

/* acc[r] += x[r] . (one block of w) for `rows` rows of x (a constant after inlining); x: the
 * block's first column in row 0. */
static inline __attribute__((always_inline)) void block_into(int64_t format, const uint8_t *q, float d, float m,
                                                             const float *x, long x_stride, const int rows,
                                                             float_vector *acc) {
    float_vector w[BLOCK / LANES];
    block_weights(format, q, d, m, w);
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < BLOCK / LANES; c++) acc[r] += w[c] * load_vector(x + r * x_stride + c * LANES);
}

/* One weight row (quants q; its blocks' scales d and minimums mn, as floats) against `rows` rows
 * of x: sums[r] = x[r] . w. */
static inline __attribute__((always_inline)) void block_row_tile(int64_t format, const uint8_t *q, const float *d,
                                                                 const float *mn, long blocks, const float *x,
                                                                 long x_stride, const int rows,
                                                                 float sums[TILE_ROWS]) {
    long qbytes = format == FORMAT_Q4_1 ? 16 : 32;
    const int chains = CHAINS(rows);
    /* four named arrays, not one [4][TILE_ROWS]: GCC kept that one in memory, not in registers */
    float_vector acc0[TILE_ROWS], acc1[TILE_ROWS], acc2[TILE_ROWS], acc3[TILE_ROWS];
    for (int r = 0; r < rows; r++) acc0[r] = acc1[r] = acc2[r] = acc3[r] = (float_vector){0};
#define BLOCK_INTO(b, acc) block_into(format, q + (b) * qbytes, d[b], mn[b], x + (b) * BLOCK, x_stride, rows, acc)
    long b = 0;
    for (; b + chains <= blocks; b += chains) {
        BLOCK_INTO(b, acc0);
        if (chains > 1) BLOCK_INTO(b + 1, acc1);
        if (chains > 2) BLOCK_INTO(b + 2, acc2);
        if (chains > 3) BLOCK_INTO(b + 3, acc3);
    }
    for (; b < blocks; b++) BLOCK_INTO(b, acc0);
#undef BLOCK_INTO
    for (int r = 0; r < rows; r++) sums[r] = sum_vector((acc0[r] + acc1[r]) + (acc2[r] + acc3[r]));
}

#define BLOCK_CASE(R) case R: block_row_tile(format, q, d, mn, blocks, xt, x_stride, R, sums); break;

/* One weight row against m rows of x, a tile at a time: y[r * y_stride] = (or +=) x[r] . w. */
static void block_row(int64_t format, const uint8_t *q, const float *d, const float *mn, long blocks,
                      const float *x, long x_stride, long m, float *y, long y_stride, int accumulate) {
    float sums[TILE_ROWS];
    for (long r0 = 0; r0 < m; r0 += TILE_ROWS) {
        long rows = m - r0 < TILE_ROWS ? m - r0 : TILE_ROWS;
        const float *xt = x + r0 * x_stride;
        switch (rows) {                                  /* a constant tile height for each case */
#if TILE_ROWS == 8
            BLOCK_CASE(8) BLOCK_CASE(7) BLOCK_CASE(6) BLOCK_CASE(5)
#endif
            BLOCK_CASE(4) BLOCK_CASE(3) BLOCK_CASE(2)
            default: block_row_tile(format, q, d, mn, blocks, xt, x_stride, 1, sums); break;
        }
        for (long r = 0; r < rows; r++) {
            float *out = y + (r0 + r) * y_stride;
            *out = accumulate ? *out + sums[r] : sums[r];
        }
    }
}

/* ------------------------------------------------------------------ a few rows of x, AVX-512 */

#if defined(__AVX512F__)
/* With few rows of x the tile code above is bound by its instructions, not by the reads: GCC keeps
 * the format test inside the block loop and spills the tile's bookkeeping to the stack. So 1 to
 * TILE_ROWS rows get loops of their own per format (the format a constant in each), written with
 * AVX-512 intrinsics, and a cheaper unpacking (one vector is one half of a block, 16 weights):
 *   - Q4_1: a block's sixteen possible weights d i + m (i = 0..15) are one vector, made with one
 *     multiply-add; vpermps then picks each weight by its nibble (it reads the low four bits of
 *     each index, so the low nibbles need no mask). The floats are the same d q + m as above,
 *     where the tile code spent a mask, two shifts, two widenings and two conversions.
 *   - Q8_0: the bytes sign-extended in one instruction (vpmovsxbd), made floats, scaled by d.
 * The results are those of the tile code up to fp32 summation order. */

/* x . w for one Q4_1 row (quants q, its blocks' scales d and minimums m as floats) and one row of x.
 * Blocks go in pairs into two pairs of accumulators: with one row, a single pair's multiply-adds
 * would each wait for the one before (CHAINS above). */
static inline float q4_1_row_dot(const uint8_t *q, const float *d, const float *m, long blocks, const float *x) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps(), acc2 = _mm512_setzero_ps(),
           acc3 = _mm512_setzero_ps();
    long b = 0;
#define Q4_1_BLOCK(b, lo, hi)                                                                         \
    do {                                                                                              \
        __m512 table = _mm512_fmadd_ps(iota, _mm512_set1_ps(d[b]), _mm512_set1_ps(m[b]));            \
        __m512i nibbles = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + (b) * 16)));   \
        lo = _mm512_fmadd_ps(_mm512_permutexvar_ps(nibbles, table), _mm512_loadu_ps(x + (b) * 32), lo); \
        hi = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(nibbles, 4), table),              \
                             _mm512_loadu_ps(x + (b) * 32 + 16), hi);                                 \
    } while (0)
    for (; b + 2 <= blocks; b += 2) {
        Q4_1_BLOCK(b, acc0, acc1);
        Q4_1_BLOCK(b + 1, acc2, acc3);
    }
    if (b < blocks) Q4_1_BLOCK(b, acc0, acc1);
#undef Q4_1_BLOCK
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc0, acc1), _mm512_add_ps(acc2, acc3)));
}

/* x . w for one Q8_0 row (quants q, its blocks' scales d as floats) and one row of x. */
static inline float q8_0_row_dot(const uint8_t *q, const float *d, long blocks, const float *x) {
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps(), acc2 = _mm512_setzero_ps(),
           acc3 = _mm512_setzero_ps();
    long b = 0;
#define Q8_0_HALF(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define Q8_0_BLOCK(b, lo, hi)                                                                         \
    do {                                                                                              \
        __m512 scale = _mm512_set1_ps(d[b]);                                                          \
        lo = _mm512_fmadd_ps(_mm512_mul_ps(Q8_0_HALF(q + (b) * 32), scale), _mm512_loadu_ps(x + (b) * 32), lo); \
        hi = _mm512_fmadd_ps(_mm512_mul_ps(Q8_0_HALF(q + (b) * 32 + 16), scale),                      \
                             _mm512_loadu_ps(x + (b) * 32 + 16), hi);                                 \
    } while (0)
    for (; b + 2 <= blocks; b += 2) {
        Q8_0_BLOCK(b, acc0, acc1);
        Q8_0_BLOCK(b + 1, acc2, acc3);
    }
    if (b < blocks) Q8_0_BLOCK(b, acc0, acc1);
#undef Q8_0_BLOCK
#undef Q8_0_HALF
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc0, acc1), _mm512_add_ps(acc2, acc3)));
}

/* Both formats against 2 to TILE_ROWS rows of x (`format` and `rows` constants after inlining): each
 * block unpacked once, then multiplied into every row, two accumulators a row (with two rows or
 * more, chains enough to hide the multiply-adds' latency). */
static inline __attribute__((always_inline)) void blocks_rows_dot(int64_t format, const uint8_t *q, const float *d,
                                                                  const float *m, long blocks, const float *x,
                                                                  long x_stride, const int rows, float sums[TILE_ROWS]) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 lo[TILE_ROWS], hi[TILE_ROWS];
    for (int r = 0; r < rows; r++) lo[r] = hi[r] = _mm512_setzero_ps();
    for (long b = 0; b < blocks; b++) {
        __m512 w0, w1;
        if (format == FORMAT_Q4_1) {
            __m512 table = _mm512_fmadd_ps(iota, _mm512_set1_ps(d[b]), _mm512_set1_ps(m[b]));
            __m512i nibbles = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + b * 16)));
            w0 = _mm512_permutexvar_ps(nibbles, table);
            w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(nibbles, 4), table);
        } else {
            __m512 scale = _mm512_set1_ps(d[b]);
            w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + b * 32)))), scale);
            w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + b * 32 + 16)))), scale);
        }
        for (int r = 0; r < rows; r++) {
            lo[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + r * x_stride + b * 32), lo[r]);
            hi[r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + r * x_stride + b * 32 + 16), hi[r]);
        }
    }
    for (int r = 0; r < rows; r++) sums[r] = _mm512_reduce_add_ps(_mm512_add_ps(lo[r], hi[r]));
}

/* Weight rows [first, last) of a chunk (d, mn: their scales and minimums from row `first` on) against
 * 2 to TILE_ROWS rows of x: y[r * y_stride + o] = (or +=) x[r] . W[o]. */
static inline __attribute__((always_inline)) void blocks_times_few_rows_format(
        int64_t format, const uint8_t *quants, long row_bytes, const float *d, const float *mn, long blocks,
        const float *x, long x_stride, const int rows, long first, long last, float *y, long y_stride, int accumulate) {
    float sums[TILE_ROWS];
    for (long o = first; o < last; o++) {
        long s = (o - first) * blocks;
        blocks_rows_dot(format, quants + o * row_bytes, d + s, mn + s, blocks, x, x_stride, rows, sums);
        for (int r = 0; r < rows; r++) y[r * y_stride + o] = accumulate ? y[r * y_stride + o] + sums[r] : sums[r];
    }
}

/* The same, one instance per format and row count, so that neither is tested inside the loops. */
#define FEW_ROWS_CASE(F, R) case R: blocks_times_few_rows_format(F, quants, row_bytes, d, mn, blocks, x, x_stride, R, first, last, y, y_stride, accumulate); break;
static void blocks_times_few_rows(int64_t format, const uint8_t *quants, long row_bytes, const float *d,
                                  const float *mn, long blocks, const float *x, long x_stride, long m, long first,
                                  long last, float *y, long y_stride, int accumulate) {
    if (format == FORMAT_Q4_1) {
        switch (m) { FEW_ROWS_CASE(FORMAT_Q4_1, 2) FEW_ROWS_CASE(FORMAT_Q4_1, 3) FEW_ROWS_CASE(FORMAT_Q4_1, 4) FEW_ROWS_CASE(FORMAT_Q4_1, 5)
                     FEW_ROWS_CASE(FORMAT_Q4_1, 6) FEW_ROWS_CASE(FORMAT_Q4_1, 7) default: FEW_ROWS_CASE(FORMAT_Q4_1, 8) }
    } else {
        switch (m) { FEW_ROWS_CASE(FORMAT_Q8_0, 2) FEW_ROWS_CASE(FORMAT_Q8_0, 3) FEW_ROWS_CASE(FORMAT_Q8_0, 4) FEW_ROWS_CASE(FORMAT_Q8_0, 5)
                     FEW_ROWS_CASE(FORMAT_Q8_0, 6) FEW_ROWS_CASE(FORMAT_Q8_0, 7) default: FEW_ROWS_CASE(FORMAT_Q8_0, 8) }
    }
}
#undef FEW_ROWS_CASE

/* Weight rows [first, last) of a chunk (d, mn as above) against one row of x: y[o] = (or +=) x . W[o]. */
static void blocks_times_one_row(int64_t format, const uint8_t *quants, long row_bytes, const float *d,
                                 const float *mn, long blocks, const float *x, long first, long last, float *y,
                                 int accumulate) {
    for (long o = first; o < last; o++) {
        const uint8_t *q = quants + o * row_bytes;
        long s = (o - first) * blocks;
        float sum = format == FORMAT_Q4_1 ? q4_1_row_dot(q, d + s, mn + s, blocks, x) : q8_0_row_dot(q, d + s, blocks, x);
        y[o] = accumulate ? y[o] + sum : sum;
    }
}
#endif

/* Weight rows whose scales (and minimums) are made floats at a time: one conversion of a
 * contiguous stretch, not a short one per row (SmolLM2's rows have 18 blocks, and per-row loops
 * with their ragged ends cost as much as the row's blocks). */
#define SCALE_ROWS 32

/* y[r * y_stride + o] = (or +=, if `accumulate`) x[r] . W[o]  for o in [first, last) and r < m:
 * one thread's share of a product. x: m rows of whole blocks (block_input), n = blocks * 32. The
 * weight rows go one at a time, front to back (one sequential stream), each against every tile of x. */
static void blocks_times_range(const float *x, long x_stride, long m, const WeightMatrix *w, long blocks, long first,
                               long last, float *y, long y_stride, int accumulate) {
    long row_bytes = quant_row_bytes(w->format, blocks);
    float d[SCALE_ROWS * blocks], mn[SCALE_ROWS * blocks];
    const float *mins = w->format == FORMAT_Q4_1 ? mn : d;   /* Q8_0 has none (block_weights reads none) */
    for (long c0 = first; c0 < last; c0 += SCALE_ROWS) {
        long c1 = c0 + SCALE_ROWS < last ? c0 + SCALE_ROWS : last;
        halves_to_floats(w->scales + c0 * blocks, d, (c1 - c0) * blocks);
        if (w->format == FORMAT_Q4_1) halves_to_floats(w->mins + c0 * blocks, mn, (c1 - c0) * blocks);
#if defined(__AVX512F__)
        /* x in tiles of up to TILE_ROWS rows through the loops above (one row, and 2 to TILE_ROWS, each have
         * their own); past TILE_ROWS the chunk's weight rows (a few KiB) stay in the L1/L2 cache from one
         * tile to the next, so the matrix is still read from memory once (the generic tiles below were
         * three times slower at 32 rows) */
        for (long r0 = 0; r0 < m; r0 += TILE_ROWS) {
            long rows = m - r0 < TILE_ROWS ? m - r0 : TILE_ROWS;
            const float *xr = x + r0 * x_stride;
            float *yr = y + r0 * y_stride;
            if (rows == 1) blocks_times_one_row(w->format, w->data, row_bytes, d, mn, blocks, xr, c0, c1, yr, accumulate);
            else blocks_times_few_rows(w->format, w->data, row_bytes, d, mn, blocks, xr, x_stride, rows, c0, c1, yr, y_stride, accumulate);
        }
        continue;
#endif
        for (long o = c0; o < c1; o++)
            block_row(w->format, (const uint8_t *)w->data + o * row_bytes, d + (o - c0) * blocks,
                      mins + (o - c0) * blocks, blocks, x, x_stride, m, y + o, y_stride, accumulate);
    }
}

#endif
