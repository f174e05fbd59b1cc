/*
 * Block copies between host tensors shaped (num_blocks, ...): row src_ids[i] of every source
 * tensor goes to row dst_ids[i] of its destination. Ids that count up by one on both sides
 * are merged into a single memcpy. One call covers every tensor of a job (a job of many
 * layers costs one call instead of one indexed copy per layer half), and its (tensor, run)
 * pieces are spread over an OpenMP team: on the engine's thread that is torch's own team,
 * already awake, so handing out work costs microseconds, not a thread-pool round trip.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Returns 0, or -1 when the run table could not be allocated (nothing was copied). */
int kvf_copy_rows(int64_t num_tensors, char *const *src, char *const *dst,
                  const int64_t *row_bytes, const int64_t *src_ids, const int64_t *dst_ids,
                  int64_t n, int num_threads) {
    int64_t *starts = malloc(sizeof(int64_t) * (size_t)(n + 1));
    if (starts == NULL) return -1;
    int64_t runs = 0;
    for (int64_t i = 0; i < n; i++)
        if (i == 0 || src_ids[i] != src_ids[i - 1] + 1 || dst_ids[i] != dst_ids[i - 1] + 1)
            starts[runs++] = i;
    starts[runs] = n;
    const int64_t items = num_tensors * runs;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (items > 1)
    for (int64_t item = 0; item < items; item++) {
        const int64_t t = item / runs, r = item % runs;
        const int64_t i = starts[r], len = starts[r + 1] - i, rb = row_bytes[t];
        memcpy(dst[t] + dst_ids[i] * rb, src[t] + src_ids[i] * rb, (size_t)(len * rb));
    }
    free(starts);
    return 0;
}
