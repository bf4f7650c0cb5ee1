/* The inner loop of the rowwise matrix product, shared by row_kernels.c and c_step.c.
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
#define CHUNK_ROWS (2 * LANES)  /* weight rows a thread takes at a time: one panel of the packed layout */

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


/* ------------------------------------------------------------------ the packed layout (panels)
 *
 * With several rows of x, the tile above still loads every x vector once per weight row and
 * ends each weight row with a sum across the vector's lanes: at 5 rows that is 10 x loads and 5
 * reductions for 2 weight loads, and the loads, not the multiply-adds, set the pace. So the C
 * step keeps its own copy of each weight as panels of PANEL_WIDTH output rows stored column by
 * column:
 *
 *   panel q (weight rows q*PANEL_WIDTH ..), column i:  w[q*PW][i], w[q*PW + 1][i], .., w[q*PW + PW-1][i]
 *
 * Then one column of a panel is two vectors holding PANEL_WIDTH outputs' weights for input i,
 * and a product is a sum of outer products: for each i, every row r of x adds x[r][i] times
 * those two vectors to its two accumulators (one broadcast, two multiply-adds). No lane sums,
 * one load of the weight for the whole tile of x, and the weight is again one sequential stream
 * (panel after panel, front to back). This is how BLAS libraries pack matrices for their own
 * inner kernels. A tile of x holds up to PANEL_TILE_ROWS rows (2 accumulators a row, of the 32
 * AVX-512 or 16 AVX2 registers); a taller step goes in equal tiles, each reading the panel
 * again, from the L2 cache after the first (a panel is PANEL_WIDTH x n floats, 72-192 KiB for
 * SmolLM2). Measured on the AMD EPYC this was written on (benchmarks/NOTES.md), from memory:
 * 1.2-1.7x oneDNN's prepacked product at 1-64 rows, level at 256.
 *
 * A range of rows starting at a multiple of PANEL_WIDTH begins at p + first * n, as in the
 * plain layout; the caller's row ranges must be whole panels (out % PANEL_WIDTH == 0). */
#define PANEL_WIDTH (2 * LANES)
#if defined(__AVX512F__)
#define PANEL_TILE_ROWS 12  /* 12 x 2 accumulators + 2 weight vectors + 1 broadcast of 32 registers */
#else
#define PANEL_TILE_ROWS 6   /* 6 x 2 + 2 + 1 of AVX2's 16 */
#endif

static inline void store_vector(float *p, float_vector v) { *(float_vector_unaligned *)p = v; }

/* One panel p against `rows` rows of x (a constant after inlining); writes (or adds to) the
 * PANEL_WIDTH outputs of each row at y + r * y_stride. */
static inline __attribute__((always_inline)) void panel_tile(const float *p, const float *x, long x_stride,
                                                             const int rows, long n, float *y, long y_stride,
                                                             int accumulate) {
    float_vector acc0[PANEL_TILE_ROWS], acc1[PANEL_TILE_ROWS];
    for (int r = 0; r < rows; r++) acc0[r] = acc1[r] = (float_vector){0};
    for (long i = 0; i < n; i++, p += PANEL_WIDTH) {
        float_vector w0 = load_vector(p), w1 = load_vector(p + LANES);
        for (int r = 0; r < rows; r++) {
            float xi = x[r * x_stride + i];
            acc0[r] += w0 * xi;
            acc1[r] += w1 * xi;
        }
    }
    for (int r = 0; r < rows; r++) {
        float *out = y + r * y_stride;
        if (accumulate) {
            acc0[r] += load_vector(out);
            acc1[r] += load_vector(out + LANES);
        }
        store_vector(out, acc0[r]);
        store_vector(out + LANES, acc1[r]);
    }
}

#define PANEL_CASE(R) case R: panel_tile(panel, xt, x_stride, R, n, yt, y_stride, accumulate); break;

/* rows_times_weight_range for a packed weight p (first and last multiples of PANEL_WIDTH). */
static void packed_times_weight_range(const float *x, long x_stride, long m, const float *p, long n,
                                      long first, long last, float *y, long y_stride, int accumulate) {
    long tiles = (m + PANEL_TILE_ROWS - 1) / PANEL_TILE_ROWS;
    long tile = (m + tiles - 1) / tiles;                 /* equal tiles: 16 rows go 8 + 8, not 12 + 4 */
    for (long o = first; o < last; o += PANEL_WIDTH) {
        const float *panel = p + o * n;
        for (long r0 = 0; r0 < m; r0 += tile) {
            long rows = m - r0 < tile ? m - r0 : tile;
            const float *xt = x + r0 * x_stride;
            float *yt = y + r0 * y_stride + o;
            switch (rows) {                                  /* a constant tile height for each case */
#if PANEL_TILE_ROWS == 12
                PANEL_CASE(12) PANEL_CASE(11) PANEL_CASE(10) PANEL_CASE(9) PANEL_CASE(8) PANEL_CASE(7)
#endif
                PANEL_CASE(6) PANEL_CASE(5) PANEL_CASE(4) PANEL_CASE(3) PANEL_CASE(2)
                default: panel_tile(panel, xt, x_stride, 1, n, yt, y_stride, accumulate); break;
            }
        }
    }
}

#endif
