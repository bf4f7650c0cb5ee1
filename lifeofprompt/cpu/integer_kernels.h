/* Block matrices times a few rows with integer dot products: shared by block_kernels.c and c_step.c.
 *
 * y[r][o] = sum_i x[r][i] * W[o][i]   for the rows r of x and a range of rows o of a block matrix W
 *
 * block_kernels.h turns every weight into a float before multiplying it: eight or so instructions
 * for 32 weights of one row, which at one row of x is as fast as a thread can go (18-21 GB/s),
 * short of what the memory delivers. The CPU's integer dot product does more per instruction:
 * vpdpbusd (AVX-512 VNNI, AVX-VNNI) multiplies 4 unsigned bytes by 4 signed bytes and adds the
 * four products into a 32-bit lane, 16 lanes at once. For it both sides must be bytes:
 *
 *   - the weights already are: Q4_1's q is 0..15, Q8_0's q a signed byte (stored here as q + 128,
 *     unsigned, and the 128 x-sum it adds taken off at the end);
 *   - x is made bytes per block of 32, as llama.cpp does, but with two digits: s = max|x| / 127,
 *     hi = round(x / s), then the rest r = x - s hi in units of s / 256, lo = round(256 r / s).
 *     x = (s / 256) (256 hi + lo) to within s / 512 (s / 256 where lo, clamped to -127..127, would
 *     have been 128): about 1/65,000 of the block's largest value,
 *     where llama.cpp's one digit (hi alone) errs by up to 1/254 of it. One digit moved SmolLM2's
 *     top-2 margins by up to 0.75 against fp32 (778 rows), more than bf16 does; the second digit costs a
 *     second vpdpbusd per four weights and buys back the accuracy (benchmarks/NOTES.md).
 *
 * A block's sum is then (d s / 256) (256 sum hi q + sum lo q) (+ m * sum x for Q4_1), the integer
 * sums exact in 32 bits.
 *
 * The weights are re-laid at load (interleaved_blocks.py) in groups of GROUP = 16 rows, so that
 * a lane is a row: for group g and block b the 16 rows' 32 weights are 8 vectors V_k (k = 0..7),
 * lane i of V_k holding weights 4k..4k+3 of row i. One vpdpbusd of V_k against x's four bytes
 * 4k..4k+3 (the same four in every lane: a broadcast) adds four products to each of the 16 rows,
 * and after the eight V_k each lane holds its row's block sum, which the 16 rows' scales (d, m:
 * fp16, stored per group and block as 16 in a row) turn into floats in one multiply-add. Q8_0
 * stores V_0..V_7 as they are (512 bytes a group and block); Q4_1 packs V_j in the low nibbles and
 * V_{j+4} in the high ones of 4 vectors (256 bytes), so a mask and a shift unpack two V's.
 *
 * Paths, chosen by the instructions this build was compiled for (-march=native: the CPU's own
 * cpuid flags): 512-bit vpdpbusd (AVX-512 VNNI), 256-bit vpdpbusd (AVX-VNNI, or AVX-512 VNNI's
 * 256-bit form), AVX2's vpmaddubsw + vpmaddwd (no VNNI: three instructions for one, and Q8_0 by
 * sign tricks, since q + 128 times a byte overflows vpmaddubsw's 16-bit sums), and plain C.
 * All give the same integer sums; the floats differ from one path to another by rounding only.
 */
#ifndef LIFEOFPROMPT_CPU_INTEGER_H
#define LIFEOFPROMPT_CPU_INTEGER_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "block_kernels.h"

#define GROUP 16           /* weight rows re-laid together, one per 32-bit lane of a 512-bit vector */
#define INT_TILE_ROWS 4    /* rows of x per pass over a group's blocks: two int accumulators each */
/* Each 64-byte load of weights first asks for the line 2 KiB ahead (the rest of this group, then the
 * next: groups follow each other in memory). The hardware's own prefetcher was not enough: on the 2-core
 * Xeon the products of a batch-1 step over the real layers took 8.9-9.4 ms without, 6.7-7.7 with, in turns
 * (1 KiB to 8 KiB ahead were alike within the noise). */
#define PREFETCH_BYTES 2048

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define INTEGER_PATH "avx512-vnni"
#elif defined(__AVX2__) && (defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__)))
#define INTEGER_PATH "avx-vnni"
#define INTEGER_256 1
#elif defined(__AVX2__)
#define INTEGER_PATH "avx2"
#define INTEGER_256 1
#else
#define INTEGER_PATH "portable"
#endif

/* ------------------------------------------------------------------ x as two int8 digits per block */

/* m rows of x, each in `blocks` blocks of 32: the digits, and per block the scale s / 256, the
 * floats' sum (Q4_1's minimums multiply it) and 128 (256 sum hi + sum lo) (what Q8_0's stored
 * q + 128 adds). The arrays live in one buffer of integer_rows_bytes (integer_rows_in). */
typedef struct {
    int8_t *hi, *lo;
    float *scale, *sum;
    int32_t *offset;
    long m, blocks;
} IntegerRows;

static inline long integer_rows_bytes(long m, long blocks) { return m * blocks * (2 * BLOCK + 3 * 4); }

static inline IntegerRows integer_rows_in(void *buffer, long m, long blocks) {
    IntegerRows rows;
    rows.scale = (float *)buffer;
    rows.sum = rows.scale + m * blocks;
    rows.offset = (int32_t *)(rows.sum + m * blocks);
    rows.hi = (int8_t *)(rows.offset + m * blocks);
    rows.lo = rows.hi + m * blocks * BLOCK;
    rows.m = m;
    rows.blocks = blocks;
    return rows;
}

/* -127..127: not -128, whose sign AVX2's vpsignb cannot flip (the path without VNNI needs that). */
static inline int clamp_byte(int v) { return v < -127 ? -127 : v > 127 ? 127 : v; }

/* One block of up to 32 floats (count of them; zeros after) into its digits. rintf rounds half to
 * even, as torch.round does (interleaved_blocks.quantize_activations computes the same digits). */
static inline void quantize_block(const float *x, long count, int8_t *hi, int8_t *lo, float *scale, float *sum,
                                  int32_t *offset) {
    float v[BLOCK], amax = 0.0f, total = 0.0f;
    for (long i = 0; i < BLOCK; i++) {
        v[i] = i < count ? x[i] : 0.0f;
        amax = fmaxf(amax, fabsf(v[i]));
        total += v[i];
    }
    float s = amax / 127.0f, inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
    int hi_sum = 0, lo_sum = 0;
    for (long i = 0; i < BLOCK; i++) {
        int h = clamp_byte((int)rintf(v[i] * inverse));
        float rest = fmaf(-(float)h, s, v[i]);  /* one rounding, on every path and in the reference */
        int l = clamp_byte((int)rintf(rest * inverse * 256.0f));
        hi[i] = (int8_t)h;
        lo[i] = (int8_t)l;
        hi_sum += h;
        lo_sum += l;
    }
    *scale = s / 256.0f;
    *sum = total;
    *offset = 128 * (256 * hi_sum + lo_sum);
}

/* Rows [r0, r1) of x (n columns, x_stride apart) into `out` (made for out->m rows of out->blocks). */
static void quantize_rows(const float *x, long x_stride, long n, long r0, long r1, IntegerRows *out) {
    long blocks = out->blocks;
    for (long r = r0; r < r1; r++)
        for (long b = 0; b < blocks; b++) {
            long count = n - b * BLOCK < BLOCK ? n - b * BLOCK : BLOCK, at = r * blocks + b;
            quantize_block(x + r * x_stride + b * BLOCK, count, out->hi + at * BLOCK, out->lo + at * BLOCK,
                           out->scale + at, out->sum + at, out->offset + at);
        }
}

/* ------------------------------------------------------------------ a group of 16 rows, 512-bit */

static inline int32_t four_bytes(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* out[r][0..16) = x[r0 + r] . W[row] for the group's 16 rows and `rows` rows of x (a constant after
 * inlining): q, d, mn point at the group's first block. */
static inline __attribute__((always_inline)) void group_dot(int64_t format, const uint8_t *q, const uint16_t *d,
                                                            const uint16_t *mn, long blocks, const IntegerRows *x,
                                                            long r0, const int rows, float *out, long out_stride,
                                                            int accumulate) {
    const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
    __m512 acc[INT_TILE_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (long b = 0; b < blocks; b++) {
        __m512i hi[INT_TILE_ROWS], lo[INT_TILE_ROWS];
        for (int r = 0; r < rows; r++) hi[r] = lo[r] = _mm512_setzero_si512();
#define DOT(v, k)                                                                                             \
    for (int r = 0; r < rows; r++) {                                                                          \
        long at = ((r0 + r) * x->blocks + b) * BLOCK + 4 * (k);                                               \
        hi[r] = _mm512_dpbusd_epi32(hi[r], v, _mm512_set1_epi32(four_bytes(x->hi + at)));                     \
        lo[r] = _mm512_dpbusd_epi32(lo[r], v, _mm512_set1_epi32(four_bytes(x->lo + at)));                     \
    }
        if (format == FORMAT_Q4_1) {
            for (int j = 0; j < 4; j++) {
                _mm_prefetch((const char *)(q + (b * 4 + j) * 64 + PREFETCH_BYTES), _MM_HINT_T0);
                __m512i packed = _mm512_loadu_si512(q + (b * 4 + j) * 64);
                __m512i low = _mm512_and_si512(packed, low_nibbles);
                __m512i high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low_nibbles);
                DOT(low, j)
                DOT(high, j + 4)
            }
        } else {
            for (int k = 0; k < 8; k++) {
                _mm_prefetch((const char *)(q + (b * 8 + k) * 64 + PREFETCH_BYTES), _MM_HINT_T0);
                __m512i v = _mm512_loadu_si512(q + (b * 8 + k) * 64);
                DOT(v, k)
            }
        }
#undef DOT
        __m512 scales = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + b * GROUP)));
        __m512 mins = format == FORMAT_Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mn + b * GROUP)))
                                            : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++) {
            long at = (r0 + r) * x->blocks + b;
            __m512i sums = _mm512_add_epi32(_mm512_slli_epi32(hi[r], 8), lo[r]);
            if (format == FORMAT_Q8_0) sums = _mm512_sub_epi32(sums, _mm512_set1_epi32(x->offset[at]));
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(scales, _mm512_set1_ps(x->scale[at])), _mm512_cvtepi32_ps(sums),
                                     acc[r]);
            if (format == FORMAT_Q4_1) acc[r] = _mm512_fmadd_ps(mins, _mm512_set1_ps(x->sum[at]), acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) {
        float *y = out + r * out_stride;
        _mm512_storeu_ps(y, accumulate ? _mm512_add_ps(_mm512_loadu_ps(y), acc[r]) : acc[r]);
    }
}

#elif defined(INTEGER_256)
/* ------------------------------------------------------------------ the same in 256-bit halves */

#if defined(__AVXVNNI__)
#define DOT_BYTES(acc, w, x) _mm256_dpbusd_avx_epi32(acc, w, x)
#elif defined(__AVX512VNNI__)
#define DOT_BYTES(acc, w, x) _mm256_dpbusd_epi32(acc, w, x)
#else
/* vpmaddubsw: pairs of byte products as saturating 16-bit sums (at most 2 * 15 * 127 for Q4_1:
 * no saturation), vpmaddwd by ones: pairs of those as 32-bit sums. */
#define DOT_BYTES(acc, w, x) \
    _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)))
#define SIGNED_WEIGHTS 1
#endif

/* Q8_0's bytes are q + 128. With VNNI they are multiplied as they are (the offset taken off at the
 * end); without, 255 * 127 * 2 overflows vpmaddubsw's 16 bits, so the signed q = byte ^ 128 is
 * used with |q| as the unsigned side and x's sign flipped where q < 0 (llama.cpp's trick). */
#if defined(SIGNED_WEIGHTS)
#define DOT_Q8(acc, w, x)                                                                                      \
    do {                                                                                                       \
        __m256i signed_q = _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80));                                 \
        acc = DOT_BYTES(acc, _mm256_sign_epi8(signed_q, signed_q), _mm256_sign_epi8(x, signed_q));            \
    } while (0)
#else
#define DOT_Q8(acc, w, x) acc = DOT_BYTES(acc, w, x)
#endif

static inline __attribute__((always_inline)) void group_dot(int64_t format, const uint8_t *q, const uint16_t *d,
                                                            const uint16_t *mn, long blocks, const IntegerRows *x,
                                                            long r0, const int rows, float *out, long out_stride,
                                                            int accumulate) {
    const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
    for (int half = 0; half < 2; half++) {           /* rows 0..7 of the group, then 8..15 */
        __m256 acc[INT_TILE_ROWS];
        for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
        for (long b = 0; b < blocks; b++) {
            __m256i hi[INT_TILE_ROWS], lo[INT_TILE_ROWS];
            for (int r = 0; r < rows; r++) hi[r] = lo[r] = _mm256_setzero_si256();
#define X_BYTES(digits, r, k) _mm256_set1_epi32(four_bytes(x->digits + ((r0 + (r)) * x->blocks + b) * BLOCK + 4 * (k)))
            if (format == FORMAT_Q4_1) {
                for (int j = 0; j < 4; j++) {
                    _mm_prefetch((const char *)(q + (b * 4 + j) * 64 + PREFETCH_BYTES), _MM_HINT_T0);
                    __m256i packed = _mm256_loadu_si256((const __m256i *)(q + (b * 4 + j) * 64 + half * 32));
                    __m256i low = _mm256_and_si256(packed, low_nibbles);
                    __m256i high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low_nibbles);
                    for (int r = 0; r < rows; r++) {
                        hi[r] = DOT_BYTES(hi[r], low, X_BYTES(hi, r, j));
                        lo[r] = DOT_BYTES(lo[r], low, X_BYTES(lo, r, j));
                        hi[r] = DOT_BYTES(hi[r], high, X_BYTES(hi, r, j + 4));
                        lo[r] = DOT_BYTES(lo[r], high, X_BYTES(lo, r, j + 4));
                    }
                }
            } else {
                for (int k = 0; k < 8; k++) {
                    _mm_prefetch((const char *)(q + (b * 8 + k) * 64 + PREFETCH_BYTES), _MM_HINT_T0);
                    __m256i v = _mm256_loadu_si256((const __m256i *)(q + (b * 8 + k) * 64 + half * 32));
                    for (int r = 0; r < rows; r++) {
                        DOT_Q8(hi[r], v, X_BYTES(hi, r, k));
                        DOT_Q8(lo[r], v, X_BYTES(lo, r, k));
                    }
                }
            }
#undef X_BYTES
            __m256 scales = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + b * GROUP + half * 8)));
            __m256 mins = format == FORMAT_Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mn + b * GROUP + half * 8)))
                                                : _mm256_setzero_ps();
            for (int r = 0; r < rows; r++) {
                long at = (r0 + r) * x->blocks + b;
                __m256i sums = _mm256_add_epi32(_mm256_slli_epi32(hi[r], 8), lo[r]);
#if !defined(SIGNED_WEIGHTS)
                if (format == FORMAT_Q8_0) sums = _mm256_sub_epi32(sums, _mm256_set1_epi32(x->offset[at]));
#endif
                acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(scales, _mm256_set1_ps(x->scale[at])), _mm256_cvtepi32_ps(sums),
                                         acc[r]);
                if (format == FORMAT_Q4_1) acc[r] = _mm256_fmadd_ps(mins, _mm256_set1_ps(x->sum[at]), acc[r]);
            }
        }
        for (int r = 0; r < rows; r++) {
            float *y = out + r * out_stride + half * 8;
            _mm256_storeu_ps(y, accumulate ? _mm256_add_ps(_mm256_loadu_ps(y), acc[r]) : acc[r]);
        }
    }
}

#else
/* ------------------------------------------------------------------ plain C: the layout spelt out */

static inline void group_dot(int64_t format, const uint8_t *q, const uint16_t *d, const uint16_t *mn, long blocks,
                             const IntegerRows *x, long r0, const int rows, float *out, long out_stride,
                             int accumulate) {
    for (int r = 0; r < rows; r++) {
        float acc[GROUP] = {0};
        for (long b = 0; b < blocks; b++) {
            long at = (r0 + r) * x->blocks + b;
            const int8_t *xh = x->hi + at * BLOCK, *xl = x->lo + at * BLOCK;
            for (int i = 0; i < GROUP; i++) {
                int32_t hi = 0, lo = 0;
                for (int k = 0; k < 8; k++)
                    for (int t = 0; t < 4; t++) {
                        int w;
                        if (format == FORMAT_Q4_1) {
                            uint8_t byte = q[(b * 4 + k % 4) * 64 + 4 * i + t];
                            w = k < 4 ? byte & 15 : byte >> 4;
                        } else {
                            w = q[(b * 8 + k) * 64 + 4 * i + t];
                        }
                        hi += w * xh[4 * k + t];
                        lo += w * xl[4 * k + t];
                    }
                int32_t sums = 256 * hi + lo - (format == FORMAT_Q8_0 ? x->offset[at] : 0);
                acc[i] += half_to_float(d[b * GROUP + i]) * x->scale[at] * (float)sums;
                if (format == FORMAT_Q4_1) acc[i] += half_to_float(mn[b * GROUP + i]) * x->sum[at];
            }
        }
        for (int i = 0; i < GROUP; i++) out[r * out_stride + i] = accumulate ? out[r * out_stride + i] + acc[i] : acc[i];
    }
}
#endif

/* ------------------------------------------------------------------ a range of rows */

#define GROUP_CASE(F, R) case R: group_dot(F, q, d, mn, blocks, x, r0, R, y + r0 * y_stride + o, y_stride, accumulate); break;

/* y[r * y_stride + o] = (or +=) x[r] . W[o] for o in [first, last) (whole groups: multiples of
 * GROUP) and every row of x: one thread's share of a product. w: a re-laid matrix
 * (FORMAT_Q8_0_X16 or FORMAT_Q4_1_X16), its group g at quants g * blocks * GROUP * (32 or 16),
 * scales and minimums g * blocks * GROUP. */
static void integer_times_range(const IntegerRows *x, const WeightMatrix *w, long blocks, long first, long last,
                                float *y, long y_stride, int accumulate) {
    int64_t format = w->format == FORMAT_Q4_1_X16 ? FORMAT_Q4_1 : FORMAT_Q8_0;
    long group_bytes = blocks * GROUP * (format == FORMAT_Q4_1 ? 16 : 32);
    for (long o = first; o < last; o += GROUP) {
        const uint8_t *q = (const uint8_t *)w->data + o / GROUP * group_bytes;
        const uint16_t *d = w->scales + o * blocks, *mn = w->mins ? w->mins + o * blocks : 0;
        for (long r0 = 0; r0 < x->m; r0 += INT_TILE_ROWS) {
            long rows = x->m - r0 < INT_TILE_ROWS ? x->m - r0 : INT_TILE_ROWS;
            if (format == FORMAT_Q4_1) {
                switch (rows) { GROUP_CASE(FORMAT_Q4_1, 1) GROUP_CASE(FORMAT_Q4_1, 2) GROUP_CASE(FORMAT_Q4_1, 3) default: GROUP_CASE(FORMAT_Q4_1, 4) }
            } else {
                switch (rows) { GROUP_CASE(FORMAT_Q8_0, 1) GROUP_CASE(FORMAT_Q8_0, 2) GROUP_CASE(FORMAT_Q8_0, 3) default: GROUP_CASE(FORMAT_Q8_0, 4) }
            }
        }
    }
}
#undef GROUP_CASE

#endif
