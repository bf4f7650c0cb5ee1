/* A few rows times a weight matrix, reading each weight row once, front to back.
 *
 * y[r][o] = sum_i x[r][i] * w[o][i]  for x [m, in], w [out, in] (row-major, fp32), y [m, out].
 *
 * A decode step multiplies one or a few rows by every weight matrix, so the cost is streaming
 * the weights from memory. Walking w row after row makes the whole matrix a sequential
 * stream, which the CPU's prefetcher follows at close to its full read rate; the rows of x
 * stay in the cache. row_kernels.h holds the inner loop (tiles of two weight rows by four rows
 * of x). Threads split the output rows in chunks (OpenMP; the runtime is torch's own when
 * torch is loaded first).
 *
 * lifeofprompt/cpu/row_kernels.py compiles this file once per machine; the engine's calibration
 * (lifeofprompt/cpu/linear_calibration.py) uses it only for the shapes where it measured fastest.
 */
#include "row_kernels.h"

void rows_times_weight(const float *x, const float *w, float *y, long m, long in, long out, int threads) {
    long chunks = (out + CHUNK_ROWS - 1) / CHUNK_ROWS;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (long c = 0; c < chunks; c++) {
        long first = c * CHUNK_ROWS, last = first + CHUNK_ROWS < out ? first + CHUNK_ROWS : out;
        rows_times_weight_range(x, in, m, w, in, first, last, y, out, 0);
    }
}
