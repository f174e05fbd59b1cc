/*
 * Row-wise argmax of fp32 logits, for greedy sampling on CPU engines.
 *
 * torch's CPU argmax walks a row one element at a time, slow for vocabulary-sized rows at
 * every decode step; here a vectorised max is followed by a search for its first
 * occurrence, so ties resolve to the lowest index as in torch. Every returned index is in
 * range whatever the values (this file is built with -ffast-math, which assumes no NaN).
 */
#include <stdint.h>

#define PARALLEL_MIN_ELEMS (1 << 16)

void kvf_argmax_f32(const float *x, int64_t row_stride, int64_t rows, int64_t cols,
                    int64_t *out, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * cols >= PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * row_stride;
        float m = row[0];
#pragma omp simd reduction(max : m)
        for (int64_t i = 0; i < cols; i++) m = row[i] > m ? row[i] : m;
        int64_t best = 0;
        for (int64_t i = 0; i < cols; i++) {
            if (row[i] == m) {
                best = i;
                break;
            }
        }
        out[r] = best;
    }
}
