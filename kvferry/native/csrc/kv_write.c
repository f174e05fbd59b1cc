/*
 * The step's new keys and values into the paged KV pool at their slots, one call for both.
 *
 * cache: (2, num_blocks, block_size, kv_heads, head_dim) in either memory order (NHD or HND;
 * the strides say which). Slot s is token s % block_size of block s / block_size. k and v:
 * [n, kv_heads, head_dim] with strided rows, each row's heads contiguous. All strides are in
 * bytes, so one build serves every dtype. Every slot is checked before anything is written.
 * A prefill's rows are split over the threads: the pool's blocks are seldom in cache, and one
 * core's misses alone cap the copy well below the memory's rate.
 */
#include <stdint.h>
#include <string.h>

/* Rows from which a write is split over the threads (decode steps stay on one). */
#define PARALLEL_ROWS 64

/* Returns 0, or -1 (nothing written) when a slot lies outside the pool. */
int kvf_write_kv(const char *k, int64_t k_row_stride, const char *v, int64_t v_row_stride,
                 const int64_t *slots, int64_t n, char *cache, int64_t kv_stride,
                 int64_t block_stride, int64_t num_blocks, int64_t block_size,
                 int64_t tok_stride, int64_t head_stride, int64_t kv_heads, int64_t head_bytes,
                 int num_threads) {
    const int64_t num_slots = num_blocks * block_size;
    for (int64_t t = 0; t < n; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return -1;
    const int dense = head_stride == head_bytes; /* NHD: a token's heads are one run */
#pragma omp parallel for num_threads(num_threads) schedule(static) if (n >= PARALLEL_ROWS)
    for (int64_t t = 0; t < n; t++) {
        char *kd =
            cache + (slots[t] / block_size) * block_stride + (slots[t] % block_size) * tok_stride;
        char *vd = kd + kv_stride;
        const char *ks = k + t * k_row_stride, *vs = v + t * v_row_stride;
        if (dense) {
            memcpy(kd, ks, (size_t)(kv_heads * head_bytes));
            memcpy(vd, vs, (size_t)(kv_heads * head_bytes));
        } else {
            for (int64_t h = 0; h < kv_heads; h++) {
                memcpy(kd + h * head_stride, ks + h * head_bytes, (size_t)head_bytes);
                memcpy(vd + h * head_stride, vs + h * head_bytes, (size_t)head_bytes);
            }
        }
    }
    return 0;
}
