/*
 * Decode attention straight from the paged KV pool, for CPU engines.
 *
 * Each request has one query token; its keys and values are read in place from the blocks
 * named by its block-table row, so nothing is gathered into a staging buffer first (with a
 * gather, every byte of context is read, written and read again). Work items are whole
 * requests, or (request, kv head) pairs when there are too few requests to keep every
 * thread busy, spread over OpenMP threads; the query heads that share a kv head are served
 * by one pass over its keys and values.
 *
 * Layouts (all C-contiguous except q's row stride and the cache's inner strides):
 *   q      [num_reqs, num_heads, head_dim], row r at q + r * q_row_stride
 *   cache  [2, num_blocks, block_size, num_kv_heads, head_dim] (keys, then values); inside a
 *          block, token t's head h starts at t * tok_stride + h * head_stride: NHD
 *          (tok_stride = num_kv_heads * head_dim, head_stride = head_dim) or HND
 *          (tok_stride = head_dim, head_stride = block_size * head_dim). Blocks are
 *          block_size * num_kv_heads * head_dim apart either way.
 *   table  [num_reqs, table_stride] block ids
 *   lens   [num_reqs] context length including the new token (>= 1)
 *   window 0, or a sliding window: the query (at position len - 1) sees only the last
 *          `window` keys; blocks wholly before them are never read (they may be null blocks)
 *   out    [num_reqs, num_heads, head_dim]
 * Accumulation is in fp32; the bf16 variant widens on load and rounds the output to nearest
 * even.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

static inline float dot(const float *a, const float *b, int64_t n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline void axpy(float *y, float a, const float *x, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

static inline void widen(float *dst, const bf16_t *src, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(src[i]);
}

/* Four dot products against one query: independent accumulators keep the FMA pipes busy
 * where a single running sum would wait on its own latency. */
static inline void dot4(const float *q, const float *k0, const float *k1, const float *k2,
                        const float *k3, int64_t n, float *s) {
    float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
    for (int64_t i = 0; i < n; i++) {
        a0 += q[i] * k0[i];
        a1 += q[i] * k1[i];
        a2 += q[i] * k2[i];
        a3 += q[i] * k3[i];
    }
    s[0] = a0;
    s[1] = a1;
    s[2] = a2;
    s[3] = a3;
}

static inline void axpy4(float *y, const float *p, const float *x0, const float *x1,
                         const float *x2, const float *x3, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) y[i] += p[0] * x0[i] + p[1] * x1[i] + p[2] * x2[i] + p[3] * x3[i];
}

/* Asks for the next block's rows while the current one is computed: blocks sit at random
 * places in the pool, so the hardware prefetcher cannot run ahead across them. */
static inline void prefetch_rows(const char *p, int64_t n, int64_t stride, int64_t bytes) {
    for (int64_t j = 0; j < n; j++)
        for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + j * stride + b, 0, 0);
}

/* One work item: request `brow`/`len`, kv heads h0 .. h0 + nh - 1 and their query heads.
 * Reading several kv heads per pass walks each token's row of the block contiguously, which
 * the hardware prefetcher streams; one head at a time would touch every other cache line.
 * nh > 1 needs the heads of a token adjacent (NHD); with HND an item has one head, whose rows
 * of a block are themselves one contiguous run.
 * qf: [nh * group, head_dim]; scores: [nh * group, len]; acc: [nh * group, head_dim] (left
 * normalised); gsum: [nh * group]; rows: 4 * nh * head_dim (bf16 only: widened rows).
 * ROW(p, slot) yields the nh heads' rows of one token, starting at p, as floats. */
#define PREFETCH_NEXT(src, t)                                                                 \
    prefetch_rows((const char *)((src) + brow[(t) / block_size] * block_elems + h0 * head_stride), \
                  len - (t) < block_size ? len - (t) : block_size,                              \
                  tok_stride * (int64_t)sizeof(*(src)), nh * head_dim * (int64_t)sizeof(*(src)))
#define DEFINE_ITEM(NAME, T, ROW)                                                             \
    static void NAME(const float *qf, const T *cache, int64_t num_blocks, int64_t block_size, \
                     int64_t num_kv_heads, int64_t head_dim, int64_t tok_stride,              \
                     int64_t head_stride, const int64_t *brow, int64_t len,                   \
                     int64_t h0, int64_t nh, int64_t group, float scale, int64_t window,       \
                     float *scores, float *acc, float *gsum, float *rows) {                   \
        (void)rows;                                                                           \
        /* First key the query sees, and the block that holds it. */                          \
        const int64_t lo = window > 0 && len > window ? len - window : 0;                     \
        const int64_t first = lo - lo % block_size;                                           \
        const int64_t block_elems = block_size * num_kv_heads * head_dim;                     \
        const int64_t nq = nh * group;                                                        \
        const T *vals = cache + num_blocks * block_elems;                                     \
        for (int64_t t0 = first; t0 < len; t0 += block_size) {                                \
            const int64_t n = len - t0 < block_size ? len - t0 : block_size;                  \
            const T *base = cache + brow[t0 / block_size] * block_elems + h0 * head_stride;   \
            if (t0 + block_size < len)                                                        \
                PREFETCH_NEXT(cache, t0 + block_size);                                        \
            int64_t j = t0 < lo ? lo - t0 : 0;                                                \
            for (; j + 4 <= n; j += 4) {                                                      \
                const float *k0 = ROW(base + j * tok_stride, 0);                              \
                const float *k1 = ROW(base + (j + 1) * tok_stride, 1);                        \
                const float *k2 = ROW(base + (j + 2) * tok_stride, 2);                        \
                const float *k3 = ROW(base + (j + 3) * tok_stride, 3);                        \
                for (int64_t x = 0; x < nq; x++) {                                            \
                    const int64_t o = (x / group) * head_dim;                                 \
                    dot4(qf + x * head_dim, k0 + o, k1 + o, k2 + o, k3 + o, head_dim,          \
                         scores + x * len + t0 + j);                                          \
                }                                                                             \
            }                                                                                 \
            for (; j < n; j++) {                                                              \
                const float *k = ROW(base + j * tok_stride, 0);                               \
                for (int64_t x = 0; x < nq; x++)                                              \
                    scores[x * len + t0 + j] =                                                \
                        dot(qf + x * head_dim, k + (x / group) * head_dim, head_dim);         \
            }                                                                                 \
        }                                                                                     \
        for (int64_t x = 0; x < nq; x++) {                                                    \
            float *sx = scores + x * len;                                                     \
            float m = sx[lo], z = 0.0f;                                                       \
            for (int64_t t = lo + 1; t < len; t++) m = sx[t] > m ? sx[t] : m;                 \
            _Pragma("omp simd reduction(+ : z)") for (int64_t t = lo; t < len; t++) {         \
                sx[t] = expf((sx[t] - m) * scale);                                            \
                z += sx[t];                                                                   \
            }                                                                                 \
            gsum[x] = z;                                                                      \
        }                                                                                     \
        memset(acc, 0, sizeof(float) * nq * head_dim);                                        \
        for (int64_t t0 = first; t0 < len; t0 += block_size) {                                \
            const int64_t n = len - t0 < block_size ? len - t0 : block_size;                  \
            const T *base = vals + brow[t0 / block_size] * block_elems + h0 * head_stride;    \
            if (t0 + block_size < len)                                                        \
                PREFETCH_NEXT(vals, t0 + block_size);                                         \
            int64_t j = t0 < lo ? lo - t0 : 0;                                                \
            for (; j + 4 <= n; j += 4) {                                                      \
                const float *v0 = ROW(base + j * tok_stride, 0);                              \
                const float *v1 = ROW(base + (j + 1) * tok_stride, 1);                        \
                const float *v2 = ROW(base + (j + 2) * tok_stride, 2);                        \
                const float *v3 = ROW(base + (j + 3) * tok_stride, 3);                        \
                for (int64_t x = 0; x < nq; x++) {                                            \
                    const int64_t o = (x / group) * head_dim;                                 \
                    axpy4(acc + x * head_dim, scores + x * len + t0 + j, v0 + o, v1 + o,      \
                          v2 + o, v3 + o, head_dim);                                          \
                }                                                                             \
            }                                                                                 \
            for (; j < n; j++) {                                                              \
                const float *v = ROW(base + j * tok_stride, 0);                               \
                for (int64_t x = 0; x < nq; x++)                                              \
                    axpy(acc + x * head_dim, scores[x * len + t0 + j],                        \
                         v + (x / group) * head_dim, head_dim);                               \
            }                                                                                 \
        }                                                                                     \
        for (int64_t x = 0; x < nq; x++) {                                                    \
            const float inv = 1.0f / gsum[x];                                                 \
            for (int64_t i = 0; i < head_dim; i++) acc[x * head_dim + i] *= inv;              \
        }                                                                                     \
    }

#define ROW_F32(p, slot) (p)
#define ROW_BF16(p, slot) \
    (widen(rows + (slot) * nh * head_dim, (p), nh * head_dim), rows + (slot) * nh * head_dim)
DEFINE_ITEM(item_f32, float, ROW_F32)
DEFINE_ITEM(item_bf16, bf16_t, ROW_BF16)

static int64_t max_len(const int64_t *lens, int64_t n) {
    int64_t m = 1;
    for (int64_t i = 0; i < n; i++)
        if (lens[i] > m) m = lens[i];
    return m;
}

/* Items are whole requests when there are enough to keep every thread busy (and a token's
 * heads are adjacent), otherwise single (request, kv head) pairs. */
static int64_t heads_per_item(int64_t num_reqs, int64_t num_kv_heads, int64_t head_dim,
                              int64_t head_stride, int num_threads) {
    if (head_stride != head_dim) return 1;
    return num_reqs >= 4 * (int64_t)num_threads ? num_kv_heads : 1;
}

/* Returns 0, or -1 when scratch memory could not be allocated. */
#define DEFINE_DRIVER(NAME, T, ITEM, WIDEN_Q, STORE_OUT)                                      \
    int NAME(const T *q, int64_t q_row_stride, const T *cache, int64_t num_blocks,           \
             int64_t block_size, int64_t num_kv_heads, int64_t head_dim, int64_t tok_stride,  \
             int64_t head_stride, const int64_t *table, int64_t table_stride,                 \
             const int64_t *lens, int64_t num_reqs, int64_t group, float scale,               \
             int64_t window, T *out, int num_threads) {                                       \
        const int64_t longest = max_len(lens, num_reqs);                                      \
        const int64_t nh =                                                                    \
            heads_per_item(num_reqs, num_kv_heads, head_dim, head_stride, num_threads);       \
        const int64_t per_kv = num_kv_heads / nh, nq = nh * group;                            \
        int failed = 0;                                                                       \
        _Pragma("omp parallel num_threads(num_threads) reduction(| : failed)") {              \
            float *scratch = malloc(sizeof(float) *                                           \
                                    (nq * (longest + 2 * head_dim + 1) + 4 * nh * head_dim)); \
            /* Every thread reaches the worksharing loop (one skipping it would hang the      \
             * others at its barrier); one without scratch only marks the call failed. */    \
            if (scratch == NULL) failed = 1;                                                  \
            float *scores = scratch, *acc = scores + nq * longest, *qf = acc + nq * head_dim; \
            float *gsum = qf + nq * head_dim, *rows = gsum + nq;                              \
            _Pragma("omp for schedule(dynamic, 1)") for (int64_t item = 0;                   \
                                                         item < num_reqs * per_kv; item++) {  \
                if (scratch == NULL) continue;                                                \
                const int64_t r = item / per_kv, h0 = (item % per_kv) * nh;                   \
                const T *qr = q + r * q_row_stride + h0 * group * head_dim;                   \
                T *o = out + (r * num_kv_heads + h0) * group * head_dim;                      \
                ITEM(WIDEN_Q(qr), cache, num_blocks, block_size, num_kv_heads, head_dim,      \
                     tok_stride, head_stride, table + r * table_stride, lens[r], h0, nh,      \
                     group, scale, window, scores, acc, gsum, rows);                          \
                STORE_OUT(o, acc, nq * head_dim);                                             \
            }                                                                                 \
            free(scratch);                                                                    \
        }                                                                                     \
        return failed ? -1 : 0;                                                               \
    }

static inline void store_f32(float *o, const float *acc, int64_t n) {
    memcpy(o, acc, sizeof(float) * n);
}

static inline void store_bf16(bf16_t *o, const float *acc, int64_t n) {
    for (int64_t i = 0; i < n; i++) o[i] = f32_to_bf16(acc[i]);
}

#define Q_F32(qr) (qr)
#define Q_BF16(qr) (widen(qf, (qr), nq * head_dim), qf)
DEFINE_DRIVER(kvf_paged_decode_f32, float, item_f32, Q_F32, store_f32)
DEFINE_DRIVER(kvf_paged_decode_bf16, bf16_t, item_bf16, Q_BF16, store_bf16)
