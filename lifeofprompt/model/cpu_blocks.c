/* A few rows times a block matrix (Q8_0 or Q4_1), reading each block once, front to back.
 *
 * y[r][o] = sum_i x[r][i] * W[o][i]  for x [m, n] fp32, W [out, n] as blocks, y [m, out] fp32.
 *
 * The inner loop is cpu_blocks.h's (shared with the C step, cpu_decode.c): each block made floats
 * in registers and multiplied into a tile of rows of x. The threads split the output rows in
 * chunks (OpenMP; the runtime is torch's own when torch is loaded first).
 *
 * lifeofprompt/model/cpu_blocks.py compiles this file once per machine.
 */
#include <stdlib.h>

#include "cpu_rows.h"
#include "cpu_blocks.h"

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
