/* The inner loop of the rowwise matrix product, shared by cpu_rows.c and cpu_decode.c.
 *
 * y[r][o] = sum_i x[r][i] * w[o][i]   for the rows r of x and a range of weight rows o.
 *
 * A step multiplies a few rows x (one per decoded token) by every weight. With one row the
 * cost is reading the weights. With several, a loop that takes the rows one at a time loads
 * every weight element once per row (from the L1 cache, after the first) and spends its
 * load slots on the same numbers again; the multiply-adds then wait on loads. So the rows go
 * in tiles: one weight row against up to eight rows of x (four without AVX-512), the partial
 * sums held in vector registers, each weight vector loaded once per tile of x. The weight rows are one sequential
 * stream, front to back, which the prefetcher follows.
 *
 * The accumulators fit the register file (AVX2: 16 registers of 8 floats; AVX-512: 32 of
 * 16), two per row of the tile; the vector types below compile to the target's own multiply-adds
 * (-O3 -march=native). Sums run in another order than BLAS's, so results agree
 * with x @ W.T up to fp32 summation order.
 */
#ifndef LIFEOFPROMPT_CPU_ROWS_H
#define LIFEOFPROMPT_CPU_ROWS_H

#if defined(__AVX512F__)
#define LANES 16
#define TILE_ROWS 8        /* rows of x per tile: 16 accumulators of the 32 vector registers */
#else
#define LANES 8
#define TILE_ROWS 4        /* 8 accumulators of AVX2's 16 registers */
#endif
#define CHUNK_ROWS 16      /* weight rows a thread takes at a time */

/* LANES floats as one vector register (GCC/Clang vector extensions: the target's own width,
 * whichever instruction set -march=native finds), and the same for unaligned loads. */
typedef float float_vector __attribute__((vector_size(LANES * sizeof(float))));
typedef float float_vector_unaligned __attribute__((vector_size(LANES * sizeof(float)), aligned(sizeof(float))));

static inline float_vector load_vector(const float *p) { return *(const float_vector_unaligned *)p; }

/* The lanes' sum, as a tree of vector adds (halves added, log2(LANES) deep). Written with
 * explicit shuffles: as a plain loop the compiler emitted a branchy scalar loop that cost as
 * much as the dot product of a 576-long row. */
typedef float float_vector_8 __attribute__((vector_size(8 * sizeof(float))));
typedef float float_vector_4 __attribute__((vector_size(4 * sizeof(float))));

#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define HAVE_SHUFFLEVECTOR 1
#endif
#endif

static inline float sum_vector(float_vector v) {
#ifdef HAVE_SHUFFLEVECTOR
#if LANES == 16
    float_vector_8 h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7)
                     + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    float_vector_8 h = v;
#endif
    float_vector_4 q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
    return (q[0] + q[2]) + (q[1] + q[3]);
#else
    float s = 0;
    for (int j = 0; j < LANES; j++) s += v[j];
    return s;
#endif
}

/* One weight row w against `rows` (1 to TILE_ROWS, a constant after inlining) rows of x, two
 * vectors at a time (two partial sums per row). */
static inline __attribute__((always_inline)) void rows_tile(const float *w, const float *x, long x_stride,
                                                            const int rows, long n, float sums[TILE_ROWS]) {
    float_vector acc0[TILE_ROWS] = {0}, acc1[TILE_ROWS] = {0};
    long i = 0;
    for (; i + 2 * LANES <= n; i += 2 * LANES) {
        float_vector a = load_vector(w + i), b = load_vector(w + i + LANES);
        for (int r = 0; r < rows; r++) {
            acc0[r] += a * load_vector(x + r * x_stride + i);
            acc1[r] += b * load_vector(x + r * x_stride + i + LANES);
        }
    }
    for (int r = 0; r < rows; r++) {
        float s = sum_vector(acc0[r] + acc1[r]);
        for (long k = i; k < n; k++) s += w[k] * x[r * x_stride + k];
        sums[r] = s;
    }
}

/* The same for a single row of x: a plain array of 2 * LANES partial sums, which the compiler
 * turns into two vector accumulators. Measured from memory on the AMD EPYC this was developed on,
 * this form streamed a weight at ~26 GB/s where the vector-type form with four accumulators
 * reached ~19: for one row the loop is bound by the reads, and the plainer loop reads better. */
static inline float row_dot(const float *w, const float *x, long n) {
    float acc[2 * LANES] = {0};
    long i = 0;
    for (; i + 2 * LANES <= n; i += 2 * LANES)
        for (int j = 0; j < 2 * LANES; j++) acc[j] += w[i + j] * x[i + j];
    float_vector total = load_vector(acc) + load_vector(acc + LANES);
    float s = sum_vector(total);
    for (; i < n; i++) s += w[i] * x[i];
    return s;
}

/* y[r * y_stride + o] = (or +=, if `accumulate`) x[r] . w[o]  for o in [first, last), r in [0, m).
 * x: [m, n] with row stride x_stride; w: [*, n] row-major. One thread's share of a product.
 * Weight rows go one at a time (one sequential stream: on the AMD EPYC this was developed on,
 * interleaving two or four row streams read memory at half the rate). */
static void rows_times_weight_range(const float *x, long x_stride, long m, const float *w, long n,
                                    long first, long last, float *y, long y_stride, int accumulate) {
    float sums[TILE_ROWS];
    for (long o = first; o < last; o++) {
        const float *w_row = w + o * n;
        for (long r0 = 0; r0 < m; r0 += TILE_ROWS) {
            long rows = m - r0 < TILE_ROWS ? m - r0 : TILE_ROWS;
            const float *xt = x + r0 * x_stride;
            switch (rows) {                                  /* a constant tile height for each case */
#if TILE_ROWS == 8
                case 8: rows_tile(w_row, xt, x_stride, 8, n, sums); break;
                case 7: rows_tile(w_row, xt, x_stride, 7, n, sums); break;
                case 6: rows_tile(w_row, xt, x_stride, 6, n, sums); break;
                case 5: rows_tile(w_row, xt, x_stride, 5, n, sums); break;
#endif
                case 4: rows_tile(w_row, xt, x_stride, 4, n, sums); break;
                case 3: rows_tile(w_row, xt, x_stride, 3, n, sums); break;
                case 2: rows_tile(w_row, xt, x_stride, 2, n, sums); break;
                default: sums[0] = row_dot(w_row, xt, n); break;
            }
            for (long r = 0; r < rows; r++) {
                float *out = y + (r0 + r) * y_stride + o;
                *out = accumulate ? *out + sums[r] : sums[r];
            }
        }
    }
}


/* ------------------------------------------------------------------ the packed layout
 *
 * With several rows of x, the tile above still loads every x vector once per weight row: at
 * 5 rows that is 10 x loads for 2 weight loads, and the loads, not the multiply-adds, set the
 * pace. Taking PACK_ROWS weight rows at once lets each x vector serve PACK_ROWS multiply-adds.
 * But four rows of a plain row-major matrix are four read streams, which the AMD EPYC this was
 * developed on reads at half the rate of one. So the C step keeps its own copy of each weight
 * with PACK_ROWS rows interleaved LANES columns at a time:
 *
 *   block b (rows 4b .. 4b+3), chunk c (columns c*LANES ..):  w[4b][c], w[4b+1][c], w[4b+2][c], w[4b+3][c]
 *
 * which is again one sequential stream, and the rows of a block sit together: a range of rows
 * starting at a multiple of PACK_ROWS begins at p + first * n, as in the plain layout.
 * Measured from memory on that machine (benchmarks/NOTES.md): 1.3-1.9x the tile above for 2-5
 * rows, the same for one row. Requires out % PACK_ROWS == 0 and n % LANES == 0. */
#define PACK_ROWS 4
#if defined(__AVX512F__)
#define PACK_TILE_ROWS 5   /* 4 x 5 accumulators + 4 weight vectors + 1 x vector of 32 registers */
#else
#define PACK_TILE_ROWS 2   /* 4 x 2 + 4 + 1 of AVX2's 16 */
#endif

/* PACK_ROWS weight rows (one packed block p) against `rows` rows of x (a constant after inlining). */
static inline __attribute__((always_inline)) void packed_tile(const float *p, const float *x, long x_stride,
                                                              const int rows, long n, float sums[][PACK_ROWS]) {
    float_vector acc[PACK_ROWS][PACK_TILE_ROWS];
    for (int a = 0; a < PACK_ROWS; a++)
        for (int r = 0; r < rows; r++) acc[a][r] = (float_vector){0};
    for (long c = 0; c < n; c += LANES, p += PACK_ROWS * LANES) {
        float_vector w0 = load_vector(p), w1 = load_vector(p + LANES), w2 = load_vector(p + 2 * LANES),
                     w3 = load_vector(p + 3 * LANES);
        for (int r = 0; r < rows; r++) {
            float_vector xv = load_vector(x + r * x_stride + c);
            acc[0][r] += w0 * xv; acc[1][r] += w1 * xv; acc[2][r] += w2 * xv; acc[3][r] += w3 * xv;
        }
    }
    for (int r = 0; r < rows; r++)
        for (int a = 0; a < PACK_ROWS; a++) sums[r][a] = sum_vector(acc[a][r]);
}

/* rows_times_weight_range for a packed weight p (first and last multiples of PACK_ROWS). A block
 * is read from memory by the first tile of x and from the L1 cache by the others. */
static void packed_times_weight_range(const float *x, long x_stride, long m, const float *p, long n,
                                      long first, long last, float *y, long y_stride, int accumulate) {
    float sums[PACK_TILE_ROWS][PACK_ROWS];
    for (long o = first; o < last; o += PACK_ROWS) {
        const float *block = p + o * n;
        for (long r0 = 0; r0 < m; r0 += PACK_TILE_ROWS) {
            long rows = m - r0 < PACK_TILE_ROWS ? m - r0 : PACK_TILE_ROWS;
            const float *xt = x + r0 * x_stride;
            switch (rows) {                                  /* a constant tile height for each case */
#if PACK_TILE_ROWS == 5
                case 5: packed_tile(block, xt, x_stride, 5, n, sums); break;
                case 4: packed_tile(block, xt, x_stride, 4, n, sums); break;
                case 3: packed_tile(block, xt, x_stride, 3, n, sums); break;
#endif
                case 2: packed_tile(block, xt, x_stride, 2, n, sums); break;
                default: packed_tile(block, xt, x_stride, 1, n, sums); break;
            }
            for (long r = 0; r < rows; r++)
                for (int a = 0; a < PACK_ROWS; a++) {
                    float *out = y + (r0 + r) * y_stride + o + a;
                    *out = accumulate ? *out + sums[r][a] : sums[r][a];
                }
        }
    }
}

#endif
