/* A few rows times a weight matrix, reading each weight row once, front to back.
 *
 * y[r][o] = sum_i x[r][i] * w[o][i]  for x [m, in], w [out, in] (row-major, fp32), y [m, out].
 *
 * A decode step multiplies one or two rows by every weight matrix, so the cost is streaming
 * the weights from memory. Walking w row after row makes the whole matrix one sequential
 * stream, which the CPU's prefetcher follows at close to its full read rate; the rows of x
 * stay in the L1 cache. The compiler turns the LANES-wide inner loop into vector
 * multiply-adds (AVX-512, AVX2 or NEON, whatever -march=native finds). Threads split the
 * output rows (OpenMP; the runtime is torch's own when torch is loaded first).
 *
 * lifeofprompt/model/cpu_rows.py compiles this file once per machine; the engine's calibration
 * (lifeofprompt/model/linear_calibration.py) uses it only for the shapes where it measured fastest.
 */
#define LANES 32

void rows_times_weight(const float *x, const float *w, float *y, long m, long in, long out, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (long o = 0; o < out; o++) {
        const float *w_row = w + o * in;
        for (long r = 0; r < m; r++) {
            const float *x_row = x + r * in;
            float acc[LANES] = {0};
            long i = 0;
            for (; i + LANES <= in; i += LANES)
                for (int j = 0; j < LANES; j++) acc[j] += w_row[i + j] * x_row[i + j];
            float sum = 0;
            for (int j = 0; j < LANES; j++) sum += acc[j];
            for (; i < in; i++) sum += w_row[i] * x_row[i];
            y[r * out + o] = sum;
        }
    }
}
