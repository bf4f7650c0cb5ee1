/* A whole Llama step on the CPU in one call: every layer, for a few query rows.
 *
 * The rows are whatever a small step holds: one-token decodes of several sequences, the k + 1
 * rows of a speculative verify, a short prefill chunk. Each row carries its own position, KV
 * slot, block table and context length (its position + 1): every row's keys and values are
 * stored before any row attends, so rows of one sequence see each other causally, as in the
 * torch path's attention.
 *
 * Why a second implementation of the layers (the reference is lifeofprompt/model/llama.py):
 * at batch 1 the torch path spends ~0.3 ms a layer outside the matrix products, in ~40 small
 * eager ops (norms, rotary, the KV store and gather, attention, SiLU, residual adds), each
 * costing microseconds of dispatch for nanoseconds of work. Here the same steps run in
 * order, in C, inside one OpenMP parallel region, so a step costs the weight reads and little
 * else. The numbers are those of the torch path up to fp32 summation order (tested in
 * tests/test_cpu_decode.py against the torch forward).
 *
 * Per layer, for each of the m rows:
 *   normed = rms_norm(residual) * w_in
 *   q, k, v = normed @ w_qkv^T;      q, k rotated (RoPE, half-split), k and v stored at slot
 *   context = softmax(q k^T * scale) v   over the sequence's keys, found through its block table
 *   residual += context @ w_o^T
 *   normed = rms_norm(residual) * w_post
 *   residual += (silu(normed @ w_gate^T) * (normed @ w_up^T)) @ w_down^T
 * and at the end hidden = rms_norm(residual) * w_final. The LM head stays with the caller.
 *
 * The products read each weight once, front to back, for all m rows at a time: one sequential
 * stream per thread, which the prefetcher follows at close to the machine's read rate, and each
 * weight vector loaded once for a whole tile of rows. Each layer matrix comes in its own format
 * (WeightMatrix, block_kernels.h): fp32 from the C step's own packed copy (panels of output rows
 * stored column by column, row_kernels.h), or fp32 row-major where the layout cannot hold the shape
 * or the caller passes no packed copies (the runner measures both ways per row count); or GGUF
 * blocks (Q8_0, Q4_1), unpacked in registers by block_kernels.h, so a quantized model's step reads
 * 5 or 8.5 bits a weight instead of 32. Threads split the heads of the qkv product (each
 * rotates and stores its own), the (row, head) pairs of attention and chunks of output rows of
 * the other products; SiLU x up is done a chunk of gate and up rows at a time, and each thread
 * normalises the residual for itself.
 *
 * Layouts (all fp32 unless a matrix is blocks, row-major, contiguous):
 *   layers[layer]: in_norm [H], post_norm [H], and the matrices qkv [(NQ + 2 NKV) D, H],
 *                  o [H, NQ D], gate_up [2 I, H] (gate rows, then up rows), down [H, I]
 *   kv: [layers, 2, num_blocks, block_size, NKV, D] fp32, or (q8_0) int8 with kv_scales beside it,
 *       [layers, 2, num_blocks, block_size, NKV, D / 32] fp16; token slot s of a sequence is
 *       block_tables[r][j / block_size] * block_size + j % block_size for its position j
 *   cos, sin: [max_positions, D / 2]
 */
#include <math.h>
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#else
static int omp_get_thread_num(void) { return 0; }
#endif

#include "row_kernels.h"
#include "block_kernels.h"
#include "integer_kernels.h"

typedef struct {
    long hidden, num_heads, num_kv_heads, head_dim, intermediate, num_layers;
    long num_blocks, block_size, max_blocks;
    float eps, scale;
    long kv_format;                               /* KV_F32, or KV_Q8_0 (kv_cache_dtype="q8_0") */
} Dims;

/* The pool's forms (model/kv_cache_formats.py): fp32 values, or q8_0's int8 codes with one fp16 scale
 * per KV_BLOCK values of a head, the scales in their own array [.., NKV, D / KV_BLOCK]. */
#define KV_F32 0
#define KV_Q8_0 1
#define KV_BLOCK 32

/* One layer's keys (or values): `codes` are floats or int8 by the form, `scales` q8_0's (else NULL). */
typedef struct {
    const void *codes;
    const uint16_t *scales;
} LayerPool;

/* IEEE float to half, rounded to nearest even: q8_0's scales, as torch's .to(torch.float16) rounds them. */
static inline uint16_t float_to_half(float f) {
#if defined(__F16C__)
    return _cvtss_sh(f, 0);
#else
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    uint16_t sign = (x >> 16) & 0x8000;
    uint32_t magnitude = x & 0x7fffffff;
    if (magnitude >= 0x47800000) return sign | (magnitude > 0x7f800000 ? 0x7e00 : 0x7c00);   /* too big, inf, NaN */
    if (magnitude < 0x38800000) {                                                             /* a subnormal half */
        float v;
        memcpy(&v, &magnitude, sizeof v);
        return sign | (uint16_t)lrintf(v * 16777216.0f);                                      /* in units of 2^-24 */
    }
    uint32_t half = ((magnitude >> 23) - 112) << 10 | (magnitude & 0x7fffff) >> 13, rest = magnitude & 0x1fff;
    if (rest > 0x1000 || (rest == 0x1000 && (half & 1))) half++;
    return sign | (uint16_t)half;
#endif
}

/* q8_0 of one head's D values into its slot: per KV_BLOCK values, scale = largest |x| / 127 rounded to
 * fp16, codes = x / scale rounded to nearest even and clamped to +-127 (kv_cache_formats.quantize). */
static void store_q8_0(const float *x, long D, int8_t *codes, uint16_t *scales) {
    for (long b = 0; b < D / KV_BLOCK; b++) {
        const float *xb = x + b * KV_BLOCK;
        float largest = 0;
        for (long i = 0; i < KV_BLOCK; i++) largest = fabsf(xb[i]) > largest ? fabsf(xb[i]) : largest;
        scales[b] = float_to_half(largest / 127);
        float step = half_to_float(scales[b]);
        for (long i = 0; i < KV_BLOCK; i++) {
            float q = step > 0 ? rintf(xb[i] / step) : 0.0f;
            codes[b * KV_BLOCK + i] = (int8_t)(q > 127 ? 127 : q < -127 ? -127 : q);
        }
    }
}

/* out[i] = scale * codes[i] for one q8_0 block of KV_BLOCK codes: sixteen (AVX-512) or eight (AVX2) sign-
 * extended and converted per instruction pair; the compiler leaves the plain loop a byte at a time. */
static inline void codes_to_floats(const int8_t *codes, float scale, float *out) {
#if defined(__AVX512F__)
    __m512 s = _mm512_set1_ps(scale);
    for (long i = 0; i < KV_BLOCK; i += 16) {
        __m512i wide = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(codes + i)));
        _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_cvtepi32_ps(wide), s));
    }
#elif defined(__AVX2__)
    __m256 s = _mm256_set1_ps(scale);
    for (long i = 0; i < KV_BLOCK; i += 8) {
        __m256i wide = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(codes + i)));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_cvtepi32_ps(wide), s));
    }
#else
    for (long i = 0; i < KV_BLOCK; i++) out[i] = scale * (float)codes[i];
#endif
}

/* The n tokens of one block from token j0, one KV head, as floats [n, D]: q8_0 codes times their scales. */
static void dequantize_block(const LayerPool *pool, const int32_t *block_table, long j0, long n, long kv_head,
                             const Dims *d, float *out) {
    long D = d->head_dim, NKV = d->num_kv_heads, S = D / KV_BLOCK;
    long first = (long)block_table[j0 / d->block_size] * d->block_size;
    const int8_t *codes = pool->codes;
    for (long t = 0; t < n; t++) {
        const int8_t *c = codes + ((first + t) * NKV + kv_head) * D;
        const uint16_t *s = pool->scales + ((first + t) * NKV + kv_head) * S;
        for (long b = 0; b < S; b++)
            codes_to_floats(c + b * KV_BLOCK, half_to_float(s[b]), out + t * D + b * KV_BLOCK);
    }
}

/* One layer's weights: the two norms and the four matrices, each in its own format. */
typedef struct {
    const float *in_norm, *post_norm;
    WeightMatrix qkv, o, gate_up, down;
} Layer;

/* y[r][o] (or +=) x[r] . W[o] for o in [first, last), whatever W's format: the packed panels, the
 * row-major rows, blocks (x, n columns, copied into `room` first where n is not whole blocks), or
 * blocks re-laid for integer products (x as its digits, made by digits_of before). */
static void times_matrix(const WeightMatrix *w, const float *x, long x_stride, long m, long n, long first, long last,
                         float *y, long y_stride, int accumulate, float *room, const IntegerRows *digits) {
    if (w->format == FORMAT_F32_PACKED) {
        packed_times_weight_range(x, x_stride, m, w->data, n, first, last, y, y_stride, accumulate);
    } else if (w->format == FORMAT_F32) {
        rows_times_weight_range(x, x_stride, m, w->data, n, first, last, y, y_stride, accumulate);
    } else if (is_interleaved(w)) {
        integer_times_range(digits, w, blocks_of(n), first, last, y, y_stride, accumulate);
    } else {
        long stride;
        const float *input = block_input(x, x_stride, m, n, room, &stride);
        blocks_times_range(input, stride, m, w, blocks_of(n), first, last, y, y_stride, accumulate);
    }
}

/* x's two int8 digits per block (integer_kernels.h) where `w` is re-laid for integer products, made
 * in `buffer` (this thread's own: every thread makes the same digits, which saves a barrier). */
static IntegerRows digits_of(const WeightMatrix *w, const float *x, long x_stride, long m, long n, void *buffer) {
    IntegerRows digits = integer_rows_in(buffer, m, blocks_of(n));
    if (is_interleaved(w)) quantize_rows(x, x_stride, n, 0, m, &digits);
    return digits;
}

static void rms_norm(const float *x, const float *weight, float *y, long m, long n, float eps) {
    for (long r = 0; r < m; r++) {
        const float *row = x + r * n;
        float sq = 0;
        for (long i = 0; i < n; i++) sq += row[i] * row[i];
        float inv = 1.0f / sqrtf(sq / (float)n + eps);
        for (long i = 0; i < n; i++) y[r * n + i] = row[i] * inv * weight[i];
    }
}

/* Rotate heads [count, D] of one row by angle tables of its position (first half with second half). */
static void rotate(float *heads, long count, long head_dim, const float *cos, const float *sin) {
    long half = head_dim / 2;
    for (long h = 0; h < count; h++) {
        float *x = heads + h * head_dim;
        for (long i = 0; i < half; i++) {
            float first = x[i], second = x[i + half];
            x[i] = first * cos[i] - second * sin[i];
            x[i + half] = second * cos[i] + first * sin[i];
        }
    }
}

/* sum_i a[i] * b[i] for a short vector (a head, 64-128 floats): vector multiply-adds where the
 * length is whole vectors, then one tree sum; a plain loop otherwise. */
static inline float short_dot(const float *a, const float *b, long n) {
    if (n % LANES == 0) {
        float_vector acc = load_vector(a) * load_vector(b);
        for (long i = LANES; i < n; i += LANES) acc += load_vector(a + i) * load_vector(b + i);
        return sum_vector(acc);
    }
    float sum = 0;
    for (long i = 0; i < n; i++) sum += a[i] * b[i];
    return sum;
}

/* p[t] = scale * (q . k[t * stride]) for t < n: one query head's scores against n keys, four keys
 * at a time. A single key's D / LANES multiply-adds form one chain, each waiting on the one before
 * (4-5 cycles on current x86): alone, that latency set attention's pace (~15 GFLOP/s at one
 * AVX2 thread). Four keys give four independent chains. Each key's sum runs in short_dot's order,
 * so the scores are the same numbers. */
static void head_scores(const float *q, const float *k, long stride, long n, long D, float scale, float *p) {
    long t = 0;
    if (D % LANES == 0) {
        for (; t + 4 <= n; t += 4) {
            const float *k0 = k + t * stride, *k1 = k0 + stride, *k2 = k1 + stride, *k3 = k2 + stride;
            float_vector qv = load_vector(q);
            float_vector a0 = qv * load_vector(k0), a1 = qv * load_vector(k1);
            float_vector a2 = qv * load_vector(k2), a3 = qv * load_vector(k3);
            for (long i = LANES; i < D; i += LANES) {
                qv = load_vector(q + i);
                a0 += qv * load_vector(k0 + i);
                a1 += qv * load_vector(k1 + i);
                a2 += qv * load_vector(k2 + i);
                a3 += qv * load_vector(k3 + i);
            }
            p[t] = sum_vector(a0) * scale;
            p[t + 1] = sum_vector(a1) * scale;
            p[t + 2] = sum_vector(a2) * scale;
            p[t + 3] = sum_vector(a3) * scale;
        }
    }
    for (; t < n; t++) p[t] = short_dot(q, k + t * stride, D) * scale;
}

/* e^x for LANES values x <= 0 (scores minus their running maximum), in vector registers (libm's
 * expf is a call per element, and GCC does not vectorise a loop of them without -ffast-math):
 * 2^(x log2 e) split into 2^n, built in the exponent bits, and e^y for |y| <= ln(2)/2 by its
 * Taylor series to y^6 (relative error ~1e-7, about fp32's own rounding). */
typedef int32_t int_vector __attribute__((vector_size(LANES * sizeof(int32_t))));

static inline float_vector exp_nonpositive(float_vector x) {
    const float_vector floor_x = (float_vector){0} - 87.0f;       /* e^-87: near fp32's smallest normal */
    int_vector low = x < floor_x;                                 /* -1 where x is below it */
    x = (float_vector)((low & (int_vector)floor_x) | (~low & (int_vector)x));
    float_vector t = x * 1.44269504f;
    int_vector n = __builtin_convertvector(t - 0.5f, int_vector);  /* round to nearest, for t <= 0 */
    float_vector y = (t - __builtin_convertvector(n, float_vector)) * 0.693147181f;
    float_vector e = 1.0f + y * (1.0f + y * (0.5f + y * (1.0f / 6 + y * (1.0f / 24
                     + y * (1.0f / 120 + y * (1.0f / 720))))));
    return e * (float_vector)((n + 127) << 23);
}

/* p[t] = e^(p[t] - max) for t < n, and their sum (p has room for n rounded up to whole vectors). */
static float exp_scores(float *p, long n, float max) {
    float total = 0;
    for (long t = 0; t < n; t += LANES) store_vector(p + t, exp_nonpositive(load_vector(p + t) - max));
    for (long t = 0; t < n; t++) total += p[t];
    return total;
}

/* o = rescale * o + sum_t p[t] * v[t * stride]  (o: one head's output, D floats). The output stays
 * in vector registers across the tokens, `count` vectors at a time: a constant after inlining
 * (with a count known only at run time the compiler kept the accumulators on the stack, and
 * every multiply-add waited on its own store, twice attention's time). */
static inline __attribute__((always_inline)) void add_weighted_vectors(float *o, float rescale, const float *p,
                                                                       const float *v, long stride, long n,
                                                                       const int count) {
    float_vector acc[8];
    for (int c = 0; c < count; c++) acc[c] = load_vector(o + c * LANES) * rescale;
    for (long t = 0; t < n; t++) {
        const float *row = v + t * stride;
        for (int c = 0; c < count; c++) acc[c] += load_vector(row + c * LANES) * p[t];
    }
    for (int c = 0; c < count; c++) store_vector(o + c * LANES, acc[c]);
}

/* The same for any head size: whole vectors in groups of up to 8 (AVX2's 16 registers hold 8
 * accumulators beside the loads), a plain loop where D is not whole vectors. Every output element
 * sums its tokens in order either way. */
static void add_weighted_rows(float *o, float rescale, const float *p, const float *v, long stride, long n, long D) {
    if (D % LANES == 0) {
        for (long c0 = 0; c0 < D / LANES; c0 += 8) {
            long count = D / LANES - c0 < 8 ? D / LANES - c0 : 8;
            float *oc = o + c0 * LANES;
            const float *vc = v + c0 * LANES;
            switch (count) {
                case 8: add_weighted_vectors(oc, rescale, p, vc, stride, n, 8); break;
                case 4: add_weighted_vectors(oc, rescale, p, vc, stride, n, 4); break;
                case 2: add_weighted_vectors(oc, rescale, p, vc, stride, n, 2); break;
                default:
                    for (long c = 0; c < count; c++) add_weighted_vectors(oc + c * LANES, rescale, p, vc + c * LANES,
                                                                         stride, n, 1);
            }
        }
        return;
    }
    for (long i = 0; i < D; i++) o[i] *= rescale;
    for (long t = 0; t < n; t++)
        for (long i = 0; i < D; i++) o[i] += p[t] * v[t * stride + i];
}

/* Where token `j0`'s block starts in a pool (all KV heads of a token are one row of NKV * D values), in bytes
 * of `value_bytes` a value (4: fp32; 1: q8_0's codes). */
static const char *block_start(const void *pool, const int32_t *block_table, long j0, const Dims *d, long value_bytes) {
    long first = (long)block_table[j0 / d->block_size] * d->block_size;
    return (const char *)pool + first * d->num_kv_heads * d->head_dim * value_bytes;
}

/* Query heads [first, first + count) of one row, over its cached keys and values from token j_start (a
 * block's first) to seq_len,
 * one block at a time with a running softmax (flash-decoding): per head a running maximum and
 * sum, and the output rescaled when the maximum grows, so keys and values are each read once,
 * block by block (a contiguous stretch of the pool the prefetcher can follow), and a block's
 * keys serve every query head of their group from the L1 cache. `q`, `out`: the row's [NQ, D]; `out` is
 * left unnormalised, with each head's running maximum and sum (-inf and 0 where the span is empty). */
static void attend_span(const float *q, const LayerPool *k_pool, const LayerPool *v_pool, const int32_t *block_table,
                        long j_start, long seq_len, const Dims *d, long first, long count, float *out,
                        float *running_max, float *running_sum) {
    long D = d->head_dim, NKV = d->num_kv_heads, group = d->num_heads / NKV, stride = NKV * D, B = d->block_size;
    long q8 = d->kv_format == KV_Q8_0, value_bytes = q8 ? 1 : (long)sizeof(float);
    for (long i = first * D; i < (first + count) * D; i++) out[i] = 0;
    float p[B + LANES];                           /* one block's scores, whole vectors */
    float k_block[q8 ? B * D : 1], v_block[q8 ? B * D : 1];          /* q8_0: one KV head's block as floats */
    for (long h = 0; h < count; h++) { running_max[h] = -INFINITY; running_sum[h] = 0; }
    for (long j0 = j_start; j0 < seq_len; j0 += B) {
        const float *k = (const float *)block_start(k_pool->codes, block_table, j0, d, value_bytes);
        const float *v = (const float *)block_start(v_pool->codes, block_table, j0, d, value_bytes);
        if (j0 + B < seq_len) {                   /* the next block, all of it: blocks lie anywhere in the pool */
            const char *next_k = block_start(k_pool->codes, block_table, j0 + B, d, value_bytes);
            const char *next_v = block_start(v_pool->codes, block_table, j0 + B, d, value_bytes);
            long bytes = (seq_len - j0 - B < B ? seq_len - j0 - B : B) * stride * value_bytes;
            for (long line = 0; line < bytes; line += 64) {
                __builtin_prefetch(next_k + line);
                __builtin_prefetch(next_v + line);
            }
        }
        long n = j0 + B < seq_len ? B : seq_len - j0, dequantized = -1;
        for (long h = first; h < first + count; h++) {
            const float *qh = q + h * D, *kh = k + (h / group) * D, *vh = v + (h / group) * D;
            long row_stride = stride;
            if (q8) {                             /* a KV head's block made floats once for its group's query heads */
                if (dequantized != h / group) {
                    dequantize_block(k_pool, block_table, j0, n, h / group, d, k_block);
                    dequantize_block(v_pool, block_table, j0, n, h / group, d, v_block);
                    dequantized = h / group;
                }
                kh = k_block, vh = v_block, row_stride = D;
            }
            float *o = out + h * D, block_max = -INFINITY;
            head_scores(qh, kh, row_stride, n, D, d->scale, p);
            for (long t = 0; t < n; t++) block_max = p[t] > block_max ? p[t] : block_max;
            float old_max = running_max[h - first], new_max = block_max > old_max ? block_max : old_max;
            float rescale = old_max == -INFINITY ? 0.0f : expf(old_max - new_max), total = 0;
            total = exp_scores(p, n, new_max);
            running_sum[h - first] = running_sum[h - first] * rescale + total;
            running_max[h - first] = new_max;
            add_weighted_rows(o, rescale, p, vh, row_stride, n, D);
        }
    }
}

/* The same over the whole sequence, normalised: out [NQ, D] for heads [first, first + count). */
static void attend_heads(const float *q, const LayerPool *k_pool, const LayerPool *v_pool, const int32_t *block_table,
                         long seq_len, const Dims *d, long first, long count, float *out) {
    long D = d->head_dim;
    float running_max[count], running_sum[count];
    attend_span(q, k_pool, v_pool, block_table, 0, seq_len, d, first, count, out, running_max, running_sum);
    for (long h = first; h < first + count; h++) {              /* no key at all (seq_len 0): zeros, as torch */
        float inverse = running_sum[h - first] > 0 ? 1.0f / running_sum[h - first] : 0.0f, *o = out + h * D;
        for (long i = 0; i < D; i++) o[i] *= inverse;
    }
}

/* Into how many parts of its blocks each row's keys are split, so that a few rows with long contexts still
 * give every thread work: 1 where the rows already make two tasks a thread. A task takes all the heads of
 * its tokens: the pool holds a token's KV heads side by side, so a task per KV head would have every thread
 * stream the whole pool (the CPU fetches neighbouring lines too) for a third of its bytes. */
static long attention_parts(long m, const Dims *d, int threads) {
    (void)d;
    return m >= 2 * threads ? 1 : (2 * threads + m - 1) / m;
}

/* Attention of m decode rows, inside a parallel region. With many rows, a row per task. With few
 * (attention_parts > 1), a (row, part of its blocks) per task, each leaving its heads' unnormalised outputs,
 * maxima and sums in `partials` ([parts, m, NQ] x (D + 2) floats, shared); then a (row, head) per task
 * merges the parts: outputs and sums rescaled to the largest maximum, added, divided. */
static void attend_rows(const float *q, long q_stride, const LayerPool *k_pool, const LayerPool *v_pool,
                        const int32_t *block_tables, const int32_t *seq_lens, const Dims *d, long m,
                        float *out, long out_stride, int threads, float *partials) {
    long NQ = d->num_heads, D = d->head_dim, B = d->block_size;
    long parts = attention_parts(m, d, threads);
    if (parts == 1) {
        #pragma omp for schedule(static)
        for (long r = 0; r < m; r++)
            attend_heads(q + r * q_stride, k_pool, v_pool, block_tables + r * d->max_blocks, seq_lens[r], d, 0, NQ,
                         out + r * out_stride);
        return;
    }
    float *part_out = partials, *part_max = partials + parts * m * NQ * D, *part_sum = part_max + parts * m * NQ;
    #pragma omp for schedule(static)
    for (long task = 0; task < m * parts; task++) {
        long r = task / parts, part = task % parts;
        long blocks = (seq_lens[r] + B - 1) / B, j_start = part * blocks / parts * B;
        long j_end = (part + 1) * blocks / parts * B < seq_lens[r] ? (part + 1) * blocks / parts * B : seq_lens[r];
        long at = (part * m + r) * NQ;
        attend_span(q + r * q_stride, k_pool, v_pool, block_tables + r * d->max_blocks, j_start, j_end, d, 0, NQ,
                    part_out + at * D, part_max + at, part_sum + at);
    }
    #pragma omp for schedule(static)
    for (long task = 0; task < m * NQ; task++) {
        long r = task / NQ, h = task % NQ;
        float largest = -INFINITY, total = 0, *o = out + r * out_stride + h * D;
        for (long part = 0; part < parts; part++) {
            float x = part_max[(part * m + r) * NQ + h];
            largest = x > largest ? x : largest;
        }
        for (long i = 0; i < D; i++) o[i] = 0;
        if (largest == -INFINITY) continue;       /* sees no key: zeros, as the torch path */
        for (long part = 0; part < parts; part++) {
            long at = (part * m + r) * NQ + h;
            if (part_max[at] == -INFINITY) continue;
            float weight = expf(part_max[at] - largest);
            total += weight * part_sum[at];
            for (long i = 0; i < D; i++) o[i] += weight * part_out[at * D + i];
        }
        for (long i = 0; i < D; i++) o[i] /= total;
    }
}

static float silu(float x) { return x / (1.0f + expf(-x)); }

/* Products are split among threads in chunks of CHUNK_ROWS weight rows (one panel). */
static long chunks(long rows) { return (rows + CHUNK_ROWS - 1) / CHUNK_ROWS; }
static long chunk_first(long c) { return c * CHUNK_ROWS; }
static long chunk_last(long c, long rows) { return (c + 1) * CHUNK_ROWS < rows ? (c + 1) * CHUNK_ROWS : rows; }

/* act[r][i] = silu(normed[r] . gate[i]) * (normed[r] . up[i]) for i in [first, last): gate row i
 * and up row I + i of the stacked gate_up weight, both products done here so no barrier
 * separates them. Each is a product of the rows from `first` (and from I + first) viewed as a
 * matrix of their own (matrix_rows), in any format. */
static void gate_up_chunk(const WeightMatrix *w_gate_up, const float *normed, long m, long H, long I, long first,
                          long last, float *act, float *room, const IntegerRows *digits) {
    long width = last - first;
    float gate[m * width], up[m * width];
    WeightMatrix gate_rows = matrix_rows(w_gate_up, first, H), up_rows = matrix_rows(w_gate_up, I + first, H);
    times_matrix(&gate_rows, normed, H, m, H, 0, width, gate, width, 0, room, digits);
    times_matrix(&up_rows, normed, H, m, H, 0, width, up, width, 0, room, digits);
    for (long r = 0; r < m; r++)
        for (long i = 0; i < width; i++) act[r * I + first + i] = silu(gate[r * width + i]) * up[r * width + i];
}

/* q, k and v of one head for every row (`head` counts q heads, then k heads, then v heads):
 * its D rows of the qkv product, rotated if a q or k head, stored into the pool if a k or v head. */
static void project_head(const WeightMatrix *w_qkv, const float *normed, float *qkv, long head, long m, const Dims *d,
                         const int64_t *positions, const int64_t *slots, const float *cos_table,
                         const float *sin_table, const LayerPool *k_pool, const LayerPool *v_pool, float *room,
                         const IntegerRows *digits) {
    long H = d->hidden, D = d->head_dim, NQ = d->num_heads, NKV = d->num_kv_heads;
    long width = (NQ + 2 * NKV) * D, half = D / 2;
    times_matrix(w_qkv, normed, H, m, H, head * D, (head + 1) * D, qkv, width, 0, room, digits);
    for (long r = 0; r < m; r++) {
        float *out = qkv + r * width + head * D;
        if (head < NQ + NKV)
            rotate(out, 1, D, cos_table + positions[r] * half, sin_table + positions[r] * half);
        if (head < NQ || slots[r] < 0) continue;
        const LayerPool *pool = head < NQ + NKV ? k_pool : v_pool;
        long kv_head = (head - NQ) % NKV, at = slots[r] * NKV + kv_head;
        if (d->kv_format == KV_Q8_0)
            store_q8_0(out, D, (int8_t *)pool->codes + at * D, (uint16_t *)pool->scales + at * (D / KV_BLOCK));
        else
            for (long i = 0; i < D; i++) ((float *)pool->codes)[at * D + i] = out[i];
    }
}

/* The whole step. Scratch buffers (caller-owned): normed [threads, m, H] (each thread normalises
 * for itself, which saves a barrier), qkv [m, (NQ + 2 NKV) D], context [m, NQ D], act [m, I],
 * room [threads, room_floats] (each thread's copy of a product's input where block matrices need
 * one: m rows of the widest input rounded up to whole blocks; then, where matrices are re-laid for
 * integer products, the digits of that input: integer_rows_bytes of it). `hidden` holds the embeddings on entry and the final
 * normalised hidden states on return. Five barriers a layer, one after each step whose
 * results every thread needs next. */
void decode_step(const Dims *d, const Layer *layers, const float *final_norm, float *hidden, long m,
                 const int64_t *positions, const int64_t *slots, const int32_t *block_tables,
                 const int32_t *seq_lens, void *kv, uint16_t *kv_scales, const float *cos_table, const float *sin_table,
                 float *normed_all, float *qkv, float *context, float *act, float *room_all, long room_floats,
                 int threads) {
    long H = d->hidden, D = d->head_dim, NQ = d->num_heads, NKV = d->num_kv_heads, I = d->intermediate;
    long qkv_width = (NQ + 2 * NKV) * D;
    long pool = d->num_blocks * d->block_size * NKV * D;           /* values in one layer's K (or V) */
    long value_bytes = d->kv_format == KV_Q8_0 ? 1 : (long)sizeof(float);
    long widest = H > NQ * D ? H : NQ * D;
    widest = blocks_of(widest > I ? widest : I) * BLOCK;
    long parts = attention_parts(m, d, threads);
    float *partials = parts > 1 ? malloc(sizeof(float) * parts * m * NQ * (D + 2)) : NULL;
    #pragma omp parallel num_threads(threads)
    {
        float *normed = normed_all + (long)omp_get_thread_num() * m * H;
        float *room = room_all + (long)omp_get_thread_num() * room_floats;
        float *digit_room = room + m * widest;
        IntegerRows digits;
        for (long layer = 0; layer < d->num_layers; layer++) {
            const Layer *w = layers + layer;
            LayerPool k_pool = {(char *)kv + 2 * layer * pool * value_bytes, NULL};
            LayerPool v_pool = {(char *)kv + (2 * layer + 1) * pool * value_bytes, NULL};
            if (kv_scales != NULL) {
                k_pool.scales = kv_scales + 2 * layer * (pool / KV_BLOCK);
                v_pool.scales = kv_scales + (2 * layer + 1) * (pool / KV_BLOCK);
            }
            rms_norm(hidden, w->in_norm, normed, m, H, d->eps);
            digits = digits_of(&w->qkv, normed, H, m, H, digit_room);
            #pragma omp for schedule(static)
            for (long head = 0; head < NQ + 2 * NKV; head++)
                project_head(&w->qkv, normed, qkv, head, m, d, positions, slots, cos_table, sin_table, &k_pool,
                             &v_pool, room, &digits);
            attend_rows(qkv, qkv_width, &k_pool, &v_pool, block_tables, seq_lens, d, m, context, NQ * D, threads,
                        partials);
            digits = digits_of(&w->o, context, NQ * D, m, NQ * D, digit_room);
            #pragma omp for schedule(static)
            for (long c = 0; c < chunks(H); c++)
                times_matrix(&w->o, context, NQ * D, m, NQ * D, chunk_first(c), chunk_last(c, H), hidden, H, 1, room,
                             &digits);
            rms_norm(hidden, w->post_norm, normed, m, H, d->eps);
            digits = digits_of(&w->gate_up, normed, H, m, H, digit_room);
            #pragma omp for schedule(static)
            for (long c = 0; c < chunks(I); c++)         /* gate rows, then the up rows I apart, then SiLU(gate) * up */
                gate_up_chunk(&w->gate_up, normed, m, H, I, chunk_first(c), chunk_last(c, I), act, room, &digits);
            digits = digits_of(&w->down, act, I, m, I, digit_room);
            #pragma omp for schedule(static)
            for (long c = 0; c < chunks(H); c++)
                times_matrix(&w->down, act, I, m, I, chunk_first(c), chunk_last(c, H), hidden, H, 1, room, &digits);
        }
    }
    free(partials);
    rms_norm(hidden, final_norm, hidden, m, H, d->eps);
}

/* The packed layout's shape (row_kernels.h), for the caller that packs the weights: weight rows per
 * panel, and floats per vector (this build's vector width). */
long packed_rows(void) { return PANEL_WIDTH; }
long packed_lanes(void) { return LANES; }

/* Attention alone, for the decode rows of any step (one query row per sequence, q [m, NQ, D]),
 * straight from the paged pool: the torch path would first copy every sequence's blocks into
 * one padded tensor. Used by the engine's torch attention on the CPU (paged_attention.py). */
void decode_attention(const Dims *d, const float *q, const void *k_codes, const void *v_codes,
                      const uint16_t *k_scales, const uint16_t *v_scales, const int32_t *block_tables,
                      const int32_t *seq_lens, float *out, long m, int threads) {
    long width = d->num_heads * d->head_dim;
    LayerPool k_pool = {k_codes, k_scales}, v_pool = {v_codes, v_scales};
    long parts = attention_parts(m, d, threads);
    float *partials = parts > 1 ? malloc(sizeof(float) * parts * m * d->num_heads * (d->head_dim + 2)) : NULL;
    #pragma omp parallel num_threads(threads)
    attend_rows(q, width, &k_pool, &v_pool, block_tables, seq_lens, d, m, out, width, threads, partials);
    free(partials);
}
