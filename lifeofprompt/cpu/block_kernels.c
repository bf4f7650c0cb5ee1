/* A few rows times a block matrix (Q8_0 or Q4_1), reading each block once, front to back.
 *
 * y[r][o] = sum_i x[r][i] * W[o][i]  for x [m, n] fp32, W [out, n] as blocks, y [m, out] fp32.
 *
 * The inner loop is block_kernels.h's (shared with the C step, c_step.c): each block made floats
 * in registers and multiplied into a tile of rows of x. The threads split the output rows in
 * chunks (OpenMP; the runtime is torch's own when torch is loaded first).
 *
 * lifeofprompt/cpu/block_kernels.py compiles this file once per machine.
 */
#include <stdlib.h>

#include "row_kernels.h"
#include "block_kernels.h"
#include "integer_kernels.h"

/* Returns 0, or -1 where the copy of x a ragged width needs could not be allocated. */
int blocks_times_weight(const float *x, long m, long n, long format, const void *quants, const uint16_t *scales,
                        const uint16_t *mins, long out, float *y, int threads) {
    WeightMatrix w = {format, quants, scales, mins};
    long blocks = blocks_of(n), stride;
    float *room = blocks * BLOCK == n ? NULL : malloc(sizeof(float) * m * blocks * BLOCK);
    if (blocks * BLOCK != n && room == NULL) return -1;
    const float *input = block_input(x, n, m, n, room, &stride);
    long chunks = (out + CHUNK_ROWS - 1) / CHUNK_ROWS;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (long c = 0; c < chunks; c++) {
        long first = c * CHUNK_ROWS, last = first + CHUNK_ROWS < out ? first + CHUNK_ROWS : out;
        blocks_times_range(input, stride, m, &w, blocks, first, last, y, out, 0);
    }
    free(room);
    return 0;
}

/* ------------------------------------------------------------------ integer products (integer_kernels.h) */

/* The same product from the blocks re-laid in groups of 16 rows (format FORMAT_Q8_0_X16 or
 * FORMAT_Q4_1_X16; `out` a multiple of 16): x is made two int8 digits per block once, by the
 * threads a share of rows each, then the threads split the groups. Returns 0, or -1 where the
 * digits' buffer could not be allocated or the shape cannot be read. */
int integer_blocks_times_weight(const float *x, long m, long n, long format, const void *quants,
                                const uint16_t *scales, const uint16_t *mins, long out, float *y, int threads) {
    WeightMatrix w = {format, quants, scales, mins};
    long blocks = blocks_of(n);
    if (!is_interleaved(&w) || out % GROUP != 0) return -1;
    void *buffer = malloc(integer_rows_bytes(m, blocks));
    if (buffer == NULL) return -1;
    IntegerRows digits = integer_rows_in(buffer, m, blocks);
    long groups = out / GROUP, chunk_groups = CHUNK_ROWS / GROUP, chunks = (groups + chunk_groups - 1) / chunk_groups;
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (long r = 0; r < m; r++) quantize_rows(x, n, n, r, r + 1, &digits);
        #pragma omp for schedule(static)
        for (long c = 0; c < chunks; c++) {
            long first = c * CHUNK_ROWS, last = first + CHUNK_ROWS < out ? first + CHUNK_ROWS : out;
            integer_times_range(&digits, &w, blocks, first, last, y, out, 0);
        }
    }
    free(buffer);
    return 0;
}

/* x's digits as integer_kernels.h makes them (for the tests): hi, lo [m, blocks * 32] int8 and per
 * block scale (s / 256), sum and offset [m, blocks]. */
void integer_quantize_rows(const float *x, long m, long n, int8_t *hi, int8_t *lo, float *scale, float *sum,
                           int32_t *offset) {
    IntegerRows digits = {hi, lo, scale, sum, offset, m, blocks_of(n)};
    quantize_rows(x, n, n, 0, m, &digits);
}

/* Which integer path this build took: "avx512-vnni", "avx-vnni", "avx2" or "portable". */
const char *integer_path(void) { return INTEGER_PATH; }

/* ------------------------------------------------------------------ rows of a block matrix as floats */

/* The weights of rows [first, last) of a block matrix as fp32 rows: out[(o - first) * width + i] =
 * d q (Q8_0) or d q + m (Q4_1) for the i < width columns of row o (width: the true row length n, or
 * the padded one, blocks_of(n) * 32). The products over many rows of x (a prompt's prefill) take
 * this route: a tile of rows dequantized here in one pass, then multiplied by BLAS.
 *
 * The floats are bit for bit those of block_formats.dequantize (torch: q as float, times d, then
 * plus m, each rounded). A fused multiply-add would give the same floats here (q has at most 8
 * bits and d, an fp16, 11, so d q is exact in fp32), but the functions below are built with
 * fp-contract off all the same, so that the equality rests on no such argument.
 * Q4_1 with AVX-512 takes the table lookup of block_kernels.h (vpermps among a block's sixteen
 * possible weights i d + m, made by a multiply and an add: the same floats). */
#if defined(__clang__)
#define NO_CONTRACT _Pragma("clang fp contract(off)")
#else
#define NO_CONTRACT
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#endif

/* One block's 32 weights into out[0..32). */
static inline __attribute__((always_inline)) void dequantize_block(int64_t format, const uint8_t *q, float d, float m,
                                                                   float *out) {
    NO_CONTRACT
#if defined(__AVX512F__)
    if (format == FORMAT_Q4_1) {
        const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        __m512 table = _mm512_add_ps(_mm512_mul_ps(iota, _mm512_set1_ps(d)), _mm512_set1_ps(m));
        __m512i nibbles = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
        _mm512_storeu_ps(out, _mm512_permutexvar_ps(nibbles, table));
        _mm512_storeu_ps(out + 16, _mm512_permutexvar_ps(_mm512_srli_epi32(nibbles, 4), table));
        return;
    }
    __m512 scale = _mm512_set1_ps(d);
    _mm512_storeu_ps(out, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q))), scale));
    _mm512_storeu_ps(out + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16)))), scale));
#else
    if (format == FORMAT_Q8_0) {
        for (int c = 0; c < BLOCK / LANES; c++)
            store_vector(out + c * LANES, (ubytes_to_floats(*(const ubyte_vector *)(q + c * LANES) ^ 0x80) - 128.0f) * d);
        return;
    }
    for (int c = 0; c < 16 / LANES; c++) {
        ubyte_vector bytes = *(const ubyte_vector *)(q + c * LANES);
        float_vector lo = ubytes_to_floats(bytes & 15) * d, hi = ubytes_to_floats(bytes >> 4) * d;
        store_vector(out + c * LANES, lo + m);
        store_vector(out + 16 + c * LANES, hi + m);
    }
#endif
}

/* Rows [first, last) of one format (a constant after inlining), `width` columns each. */
static inline __attribute__((always_inline)) void dequantize_range(int64_t format, const uint8_t *quants,
                                                                   const uint16_t *scales, const uint16_t *mins,
                                                                   long blocks, long width, long first, long last,
                                                                   float *out, long out_first) {
    long row_bytes = quant_row_bytes(format, blocks), whole = width / BLOCK;
    float d[blocks], m[blocks], tail[BLOCK];
    for (long o = first; o < last; o++) {
        halves_to_floats(scales + o * blocks, d, blocks);
        if (format == FORMAT_Q4_1) halves_to_floats(mins + o * blocks, m, blocks);
        const uint8_t *q = quants + o * row_bytes;
        float *y = out + (o - out_first) * width;
        long qbytes = format == FORMAT_Q4_1 ? 16 : 32;
        for (long b = 0; b < whole; b++)
            dequantize_block(format, q + b * qbytes, d[b], format == FORMAT_Q4_1 ? m[b] : 0.0f, y + b * BLOCK);
        if (whole * BLOCK < width) {    /* a ragged last block: its first width - whole * 32 weights */
            dequantize_block(format, q + whole * qbytes, d[whole], format == FORMAT_Q4_1 ? m[whole] : 0.0f, tail);
            memcpy(y + whole * BLOCK, tail, sizeof(float) * (width - whole * BLOCK));
        }
    }
}

/* Rows [first, last) of the matrix (n: its true row length; width: n or blocks_of(n) * 32) into
 * out [last - first, width], the threads splitting the rows. Returns 0, or -1 for a bad width or format. */
int dequantize_rows(long format, const void *quants, const uint16_t *scales, const uint16_t *mins, long n,
                    long first, long last, float *out, long width, int threads) {
    long blocks = blocks_of(n);
    if ((width != n && width != blocks * BLOCK) || (format != FORMAT_Q8_0 && format != FORMAT_Q4_1)) return -1;
    long chunks = (last - first + CHUNK_ROWS - 1) / CHUNK_ROWS;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (long c = 0; c < chunks; c++) {
        long r0 = first + c * CHUNK_ROWS, r1 = r0 + CHUNK_ROWS < last ? r0 + CHUNK_ROWS : last;
        if (format == FORMAT_Q4_1) dequantize_range(FORMAT_Q4_1, quants, scales, mins, blocks, width, r0, r1, out, first);
        else dequantize_range(FORMAT_Q8_0, quants, scales, mins, blocks, width, r0, r1, out, first);
    }
    return 0;
}

#if !defined(__clang__)
#pragma GCC pop_options
#endif
#undef NO_CONTRACT
