/*
 * Decode attention straight from the paged KV pool, for CPU engines.
 *
 * Each request has one query token; its keys and values are read in place from the blocks
 * named by its block-table row, so nothing is gathered into a staging buffer first (with a
 * gather, every byte of context is read, written and read again). Work items are runs of
 * a request's kv heads (whole requests when there are enough of them to keep every thread
 * busy), or, in a call of a few requests, parts of a request's keys over all its heads,
 * merged afterwards; they are spread over OpenMP threads, and the query heads that share a
 * kv head are served by one pass over its keys and values.
 *
 * Variants (the `variant` argument, KVF_SCALAR, KVF_AVX2 or KVF_AVX512;
 * kvf_paged_decode_variants() says which are in this build, and the caller must only ask for
 * one the CPU runs): vector items serve calls whose head_dim the variant's vectors tile (16
 * floats for AVX-512, 8 for AVX2, the widest that fits), the portable items the rest.
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
#include "variants.h"

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

/* The first key a query at position len - 1 sees: 0, or the start of its sliding window. */
static inline int64_t first_key(int64_t len, int64_t window) {
    return window > 0 && len > window ? len - window : 0;
}

/* Scores [nq][stride] (keys lo .. hi - 1 used) to exp((s - max) * scale), in place; gsum[x]
 * gets row x's sum and, unless gmax is NULL, gmax[x] its max (for merge_parts). */
static inline void softmax_rows(float *scores, int64_t nq, int64_t stride, int64_t lo,
                                int64_t hi, float scale, float *gmax, float *gsum) {
    for (int64_t x = 0; x < nq; x++) {
        float *sx = scores + x * stride;
        float m = sx[lo], z = 0.0f;
        for (int64_t t = lo + 1; t < hi; t++) m = sx[t] > m ? sx[t] : m;
#pragma omp simd reduction(+ : z)
        for (int64_t t = lo; t < hi; t++) {
            sx[t] = expf((sx[t] - m) * scale);
            z += sx[t];
        }
        if (gmax) gmax[x] = m;
        gsum[x] = z;
    }
}

/* Divides each of the nq rows of acc [nq][head_dim] by its softmax sum. */
static inline void normalise_rows(float *acc, const float *gsum, int64_t nq, int64_t head_dim) {
    for (int64_t x = 0; x < nq; x++) {
        const float inv = 1.0f / gsum[x];
        for (int64_t i = 0; i < head_dim; i++) acc[x * head_dim + i] *= inv;
    }
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
 * The item covers the request's tokens [a, b): a is a multiple of block_size, no earlier than
 * the block of the window's first key; b is a multiple of block_size or len. With gmax NULL
 * that is the whole request and acc is left normalised; otherwise it is one part of the
 * request (see PART_BLOCKS) and acc is left unnormalised, gmax and gsum holding each row's
 * score max and softmax sum for merge_parts.
 * qf: [nh * group, head_dim]; scores: [nh * group, len]; acc: [nh * group, head_dim];
 * gmax, gsum: [nh * group]; rows: 4 * nh * head_dim (bf16 only: widened rows).
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
                     int64_t a, int64_t b, float *scores, float *acc, float *gmax,             \
                     float *gsum, float *rows) {                                              \
        (void)rows;                                                                           \
        /* First key the query sees. */                                                       \
        const int64_t lo = first_key(len, window);                                            \
        const int64_t block_elems = block_size * num_kv_heads * head_dim;                     \
        const int64_t nq = nh * group;                                                        \
        const T *vals = cache + num_blocks * block_elems;                                     \
        for (int64_t t0 = a; t0 < b; t0 += block_size) {                                      \
            const int64_t n = len - t0 < block_size ? len - t0 : block_size;                  \
            const T *base = cache + brow[t0 / block_size] * block_elems + h0 * head_stride;   \
            if (t0 + block_size < b)                                                          \
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
        softmax_rows(scores, nq, len, a > lo ? a : lo, b, scale, gmax, gsum);                 \
        memset(acc, 0, sizeof(float) * nq * head_dim);                                        \
        for (int64_t t0 = a; t0 < b; t0 += block_size) {                                      \
            const int64_t n = len - t0 < block_size ? len - t0 : block_size;                  \
            const T *base = vals + brow[t0 / block_size] * block_elems + h0 * head_stride;    \
            if (t0 + block_size < b)                                                          \
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
        if (!gmax) normalise_rows(acc, gsum, nq, head_dim);                                   \
    }

#define ROW_F32(p, slot) (p)
#define ROW_BF16(p, slot) \
    (widen(rows + (slot) * nh * head_dim, (p), nh * head_dim), rows + (slot) * nh * head_dim)
DEFINE_ITEM(item_f32, float, ROW_F32)
DEFINE_ITEM(item_bf16, bf16_t, ROW_BF16)

#if defined(__x86_64__) && defined(__GNUC__)
#include "avx2.h"

/* ---- vector items: the same arithmetic with bf16 widened in registers ------------------
 * The portable item is bound by its own instructions, not by memory: bf16 rows widened
 * through a buffer, one horizontal sum per score. Here four tokens' scores for two query
 * heads build up in eight registers over one pass of the keys and four sums are reduced at
 * once; the values are added four tokens at a time into two query heads' rows. One body,
 * two widths: AVX2 (8 lanes) and AVX-512 (16 lanes, half the instructions per byte, which
 * lets the reads overlap the arithmetic better), compiled through target attributes whatever
 * -march says. PF 1: each run of four tokens prefetches the next four's rows (the next
 * block's first four at a block's end) into L1; bf16 reads gain 5-16% from it, fp32 ones
 * lose 7-16% (AVX2-only Zen 2). PF 2: each run prefetches the same four rows of the block
 * the pass reads next (the values' first block after the keys' last), which no hardware
 * prefetcher can guess: fp32 reads gain 17-45% from it, bf16 ones do not (Intel Xeon with
 * AMX; docs/benchmarks.md). It asks for L2, not L1: a run's lines asked for at once would
 * queue behind L1's few fill buffers and stall the arithmetic behind them. */

#define V_ATTR_avx2 __attribute__((target("avx2,fma")))
#define V_ATTR_avx512 __attribute__((target("avx512f,avx2,fma")))

#define avx2_vec __m256
#define avx2_W 8
#define avx2_zero() _mm256_setzero_ps()
#define avx2_loadu(p) _mm256_loadu_ps(p)
#define avx2_storeu(p, v) _mm256_storeu_ps(p, v)
#define avx2_fma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define avx2_set1(x) _mm256_set1_ps(x)
#define avx2_hsum(a) hsum256(a)
#define avx2_hsum4(a0, a1, a2, a3) hsum4(a0, a1, a2, a3)
#define avx2_load_f32(p) _mm256_loadu_ps(p)
#define avx2_load_bf16(p) widen256(p)

#define avx512_vec __m512
#define avx512_W 16
#define avx512_zero() _mm512_setzero_ps()
#define avx512_loadu(p) _mm512_loadu_ps(p)
#define avx512_storeu(p, v) _mm512_storeu_ps(p, v)
#define avx512_fma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define avx512_set1(x) _mm512_set1_ps(x)
#define avx512_hsum(a) _mm512_reduce_add_ps(a)
#define avx512_hsum4(a0, a1, a2, a3) hsum4(fold512(a0), fold512(a1), fold512(a2), fold512(a3))
#define avx512_load_f32(p) _mm512_loadu_ps(p)
#define avx512_load_bf16(p) widen512(p)

/* The lane sums of a0..a3, in that order. */
KVF_AVX2_FN __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

#define KVF_AVX512_FN __attribute__((target("avx512f,avx2,fma"), always_inline)) static inline

/* 16 lanes summed pairwise into 8 (lane i + lane i + 8). */
KVF_AVX512_FN __m256 fold512(__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

/* 16 bf16 as 16 fp32, in order (see widen256). */
KVF_AVX512_FN __m512 widen512(const uint16_t *p) {
    __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}

/* Row j of the block at `base`: the item's heads of its token j. */
#define ROW_AT(base, j) ((base) + (j) * tok_stride)

#define DEFINE_VEC_ITEM(NAME, T, V, LOAD, PF)                                                 \
    /* Scores of tokens k, k + ts, k + 2ts, k + 3ts against query rows qa and qb. */          \
    V_ATTR_##V static inline void NAME##_k4x2(const float *qa, const float *qb, const T *k,  \
                                              int64_t ts, int64_t d, float *sa, float *sb) { \
        V##_vec a0 = V##_zero(), a1 = a0, a2 = a0, a3 = a0;                                   \
        V##_vec b0 = a0, b1 = a0, b2 = a0, b3 = a0;                                           \
        for (int64_t c = 0; c < d; c += V##_W) {                                              \
            const V##_vec q0 = V##_loadu(qa + c), q1 = V##_loadu(qb + c);                     \
            const V##_vec k0 = LOAD(k + c), k1 = LOAD(k + ts + c);                            \
            const V##_vec k2 = LOAD(k + 2 * ts + c), k3 = LOAD(k + 3 * ts + c);               \
            a0 = V##_fma(q0, k0, a0);                                                         \
            a1 = V##_fma(q0, k1, a1);                                                         \
            a2 = V##_fma(q0, k2, a2);                                                         \
            a3 = V##_fma(q0, k3, a3);                                                         \
            b0 = V##_fma(q1, k0, b0);                                                         \
            b1 = V##_fma(q1, k1, b1);                                                         \
            b2 = V##_fma(q1, k2, b2);                                                         \
            b3 = V##_fma(q1, k3, b3);                                                         \
        }                                                                                     \
        _mm_storeu_ps(sa, V##_hsum4(a0, a1, a2, a3));                                         \
        _mm_storeu_ps(sb, V##_hsum4(b0, b1, b2, b3));                                         \
    }                                                                                         \
    V_ATTR_##V static inline void NAME##_k4x1(const float *qa, const T *k, int64_t ts,       \
                                              int64_t d, float *sa) {                         \
        V##_vec a0 = V##_zero(), a1 = a0, a2 = a0, a3 = a0;                                   \
        for (int64_t c = 0; c < d; c += V##_W) {                                              \
            const V##_vec q0 = V##_loadu(qa + c);                                             \
            a0 = V##_fma(q0, LOAD(k + c), a0);                                                \
            a1 = V##_fma(q0, LOAD(k + ts + c), a1);                                           \
            a2 = V##_fma(q0, LOAD(k + 2 * ts + c), a2);                                       \
            a3 = V##_fma(q0, LOAD(k + 3 * ts + c), a3);                                       \
        }                                                                                     \
        _mm_storeu_ps(sa, V##_hsum4(a0, a1, a2, a3));                                         \
    }                                                                                         \
    V_ATTR_##V static inline float NAME##_k1(const float *qa, const T *k, int64_t d) {       \
        V##_vec a = V##_zero();                                                               \
        for (int64_t c = 0; c < d; c += V##_W) a = V##_fma(V##_loadu(qa + c), LOAD(k + c), a); \
        return V##_hsum(a);                                                                   \
    }                                                                                         \
    /* y += p[0] v + p[1] v[ts] + p[2] v[2ts] + p[3] v[3ts] for n query heads: rows y ys    \
     * apart, their scores p ps apart. */                                                  \
    V_ATTR_##V static inline void NAME##_v4(float *y, int64_t ys, const float *p, int64_t ps, \
                                            int64_t n, const T *v, int64_t ts, int64_t d) {   \
        for (int64_t x = 0; x + 1 < n; x += 2) {                                              \
            const float *pa = p + x * ps, *pb = pa + ps;                                      \
            const V##_vec a0 = V##_set1(pa[0]), a1 = V##_set1(pa[1]);                         \
            const V##_vec a2 = V##_set1(pa[2]), a3 = V##_set1(pa[3]);                         \
            const V##_vec b0 = V##_set1(pb[0]), b1 = V##_set1(pb[1]);                         \
            const V##_vec b2 = V##_set1(pb[2]), b3 = V##_set1(pb[3]);                         \
            float *ya = y + x * ys, *yb = ya + ys;                                            \
            for (int64_t c = 0; c < d; c += V##_W) {                                          \
                const V##_vec v0 = LOAD(v + c), v1 = LOAD(v + ts + c);                        \
                const V##_vec v2 = LOAD(v + 2 * ts + c), v3 = LOAD(v + 3 * ts + c);           \
                V##_vec s = V##_loadu(ya + c), t = V##_loadu(yb + c);                         \
                s = V##_fma(a0, v0, s);                                                       \
                t = V##_fma(b0, v0, t);                                                       \
                s = V##_fma(a1, v1, s);                                                       \
                t = V##_fma(b1, v1, t);                                                       \
                s = V##_fma(a2, v2, s);                                                       \
                t = V##_fma(b2, v2, t);                                                       \
                s = V##_fma(a3, v3, s);                                                       \
                t = V##_fma(b3, v3, t);                                                       \
                V##_storeu(ya + c, s);                                                        \
                V##_storeu(yb + c, t);                                                        \
            }                                                                                 \
        }                                                                                     \
        if (n % 2) {                                                                          \
            const float *pa = p + (n - 1) * ps;                                               \
            const V##_vec a0 = V##_set1(pa[0]), a1 = V##_set1(pa[1]);                         \
            const V##_vec a2 = V##_set1(pa[2]), a3 = V##_set1(pa[3]);                         \
            float *ya = y + (n - 1) * ys;                                                     \
            for (int64_t c = 0; c < d; c += V##_W) {                                          \
                V##_vec s = V##_loadu(ya + c);                                                \
                s = V##_fma(a0, LOAD(v + c), s);                                              \
                s = V##_fma(a1, LOAD(v + ts + c), s);                                         \
                s = V##_fma(a2, LOAD(v + 2 * ts + c), s);                                     \
                s = V##_fma(a3, LOAD(v + 3 * ts + c), s);                                     \
                V##_storeu(ya + c, s);                                                        \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
    V_ATTR_##V static inline void NAME##_v1(float *y, int64_t ys, const float *p, int64_t ps, \
                                            int64_t n, const T *v, int64_t d) {               \
        for (int64_t x = 0; x < n; x++) {                                                     \
            const V##_vec a = V##_set1(p[x * ps]);                                            \
            for (int64_t c = 0; c < d; c += V##_W)                                            \
                V##_storeu(y + x * ys + c, V##_fma(a, LOAD(v + c), V##_loadu(y + x * ys + c))); \
        }                                                                                     \
    }                                                                                         \
    /* The portable item's contract, with two passes (keys, then values) over its blocks,   \
     * four rows at a time. */                                                                \
    V_ATTR_##V static void NAME(const float *qf, const T *cache, int64_t num_blocks,         \
                                int64_t block_size, int64_t num_kv_heads, int64_t head_dim,   \
                                int64_t tok_stride, int64_t head_stride, const int64_t *brow, \
                                int64_t len, int64_t h0, int64_t nh, int64_t group,           \
                                float scale, int64_t window, int64_t a, int64_t b,            \
                                float *scores, float *acc, float *gmax, float *gsum,          \
                                float *rows) {                                                \
        (void)rows;                                                                           \
        const int64_t lo = first_key(len, window);                                            \
        const int64_t block_elems = block_size * num_kv_heads * head_dim;                     \
        const int64_t nq = nh * group, d = head_dim, ts = tok_stride;                         \
        for (int pass = 0; pass < 2; pass++) {                                                \
            const T *src = cache + pass * num_blocks * block_elems;                           \
            if (pass == 1) {                                                                  \
                softmax_rows(scores, nq, len, a > lo ? a : lo, b, scale, gmax, gsum);         \
                memset(acc, 0, sizeof(float) * nq * head_dim);                                \
            }                                                                                 \
            for (int64_t t0 = a; t0 < b; t0 += block_size) {                                  \
                const int64_t n = len - t0 < block_size ? len - t0 : block_size;              \
                const T *base = src + brow[t0 / block_size] * block_elems + h0 * head_stride; \
                int64_t j = t0 < lo ? lo - t0 : 0;                                            \
                /* The next block's rows, for the prefetch of the block's last run. */        \
                const T *nextb = PF == 1 && t0 + block_size + 4 <= b                          \
                                     ? src + brow[t0 / block_size + 1] * block_elems +         \
                                           h0 * head_stride                                   \
                                     : 0;                                                     \
                /* PF 2: the block this pass reads next, or the values' first. */             \
                const int64_t ahead_id = PF != 2                  ? -1                        \
                                         : t0 + block_size < b    ? brow[t0 / block_size + 1] \
                                         : pass == 0              ? num_blocks + brow[a / block_size] \
                                                                  : -1;                       \
                const T *ahead = ahead_id < 0 ? 0                                             \
                                              : src + ahead_id * block_elems + h0 * head_stride; \
                for (; j + 4 <= n; j += 4) {                                                  \
                    for (int64_t h = 0; h < nh; h++) {                                        \
                        const T *r = ROW_AT(base, j) + h * head_stride;                       \
                        /* This head's rows of the next four tokens. */                       \
                        const T *pf = PF == 2      ? (ahead ? ROW_AT(ahead, j) + h * head_stride : 0) \
                                      : !PF        ? 0                                        \
                                      : j + 8 <= n ? r + 4 * ts                               \
                                      : nextb      ? nextb + h * head_stride                  \
                                                   : 0;                                       \
                        for (int64_t u = 0; pf && u < 4; u++)                                 \
                            for (int64_t c = 0; c < d * (int64_t)sizeof(T); c += 64)          \
                                _mm_prefetch((const char *)(pf + u * ts) + c,                 \
                                             PF == 2 ? _MM_HINT_T1 : _MM_HINT_T0);            \
                        const int64_t x0 = h * group;                                         \
                        if (pass == 0) {                                                      \
                            int64_t x = x0;                                                   \
                            for (; x + 1 < x0 + group; x += 2)                                \
                                NAME##_k4x2(qf + x * d, qf + (x + 1) * d, r, ts, d,            \
                                            scores + x * len + t0 + j,                        \
                                            scores + (x + 1) * len + t0 + j);                 \
                            if (x < x0 + group)                                               \
                                NAME##_k4x1(qf + x * d, r, ts, d, scores + x * len + t0 + j); \
                        } else {                                                              \
                            NAME##_v4(acc + x0 * d, d, scores + x0 * len + t0 + j, len, group, \
                                      r, ts, d);                                              \
                        }                                                                     \
                    }                                                                         \
                }                                                                             \
                for (; j < n; j++) {                                                          \
                    for (int64_t h = 0; h < nh; h++) {                                        \
                        const T *r = ROW_AT(base, j) + h * head_stride;                       \
                        const int64_t x0 = h * group;                                         \
                        if (pass == 0)                                                        \
                            for (int64_t x = x0; x < x0 + group; x++)                         \
                                scores[x * len + t0 + j] = NAME##_k1(qf + x * d, r, d);       \
                        else                                                                  \
                            NAME##_v1(acc + x0 * d, d, scores + x0 * len + t0 + j, len, group, \
                                      r, d);                                                  \
                    }                                                                         \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        if (!gmax) normalise_rows(acc, gsum, nq, head_dim);                                   \
    }

DEFINE_VEC_ITEM(avx2_item_f32, float, avx2, avx2_load_f32, 2)
DEFINE_VEC_ITEM(avx2_item_bf16, bf16_t, avx2, avx2_load_bf16, 1)
DEFINE_VEC_ITEM(avx512_item_f32, float, avx512, avx512_load_f32, 2)
DEFINE_VEC_ITEM(avx512_item_bf16, bf16_t, avx512, avx512_load_bf16, 1)
#define KVF_VARIANTS ((1 << KVF_SCALAR) | (1 << KVF_AVX2) | (1 << KVF_AVX512))
#else
#define KVF_VARIANTS (1 << KVF_SCALAR)
#define avx2_item_f32 item_f32
#define avx2_item_bf16 item_bf16
#define avx512_item_f32 item_f32
#define avx512_item_bf16 item_bf16
#endif

static int64_t max_len(const int64_t *lens, int64_t n) {
    int64_t m = 1;
    for (int64_t i = 0; i < n; i++)
        if (lens[i] > m) m = lens[i];
    return m;
}

/* Items are runs of adjacent kv heads of one request (whole requests when there are
 * enough of them), single (request, kv head) pairs where a token's heads are not adjacent. */
static int64_t heads_per_item(int64_t num_reqs, int64_t num_kv_heads, int64_t head_dim,
                              int64_t head_stride, int num_threads) {
    if (head_stride != head_dim) return 1;
    /* The most heads per item that still leaves enough items to balance: plenty for the
     * dynamic schedule, or a whole number per thread (items of one request are equal). */
    for (int64_t nh = num_kv_heads; nh > 1; nh--) {
        if (num_kv_heads % nh) continue;
        const int64_t items = num_reqs * (num_kv_heads / nh);
        if (items >= 4 * (int64_t)num_threads || (items >= num_threads && items % num_threads == 0))
            return nh;
    }
    return 1;
}

/* Below this many requests in a call, each request's keys are split into parts of at least
 * PART_BLOCKS blocks (at most MAX_PARTS), each its own work item over all the kv heads, and
 * the parts' results are merged. A few requests otherwise give a thread a run of heads whose
 * rows it reads every other kilobyte of, or a whole request while the other threads idle.
 * The parts depend on the lengths only, never on the thread count, so the result's bits do
 * not either. */
#define SPLIT_BELOW_REQS 4
#define PART_BLOCKS 4
#define MAX_PARTS 4

/* How many blocks a request's query reads, from block *first on. */
static int64_t window_blocks(int64_t len, int64_t window, int64_t block_size, int64_t *first) {
    *first = first_key(len, window) / block_size;
    return (len + block_size - 1) / block_size - *first;
}

static int64_t parts_of(int64_t len, int64_t window, int64_t block_size) {
    int64_t b0;
    const int64_t p = window_blocks(len, window, block_size, &b0) / PART_BLOCKS;
    return p < 1 ? 1 : p > MAX_PARTS ? MAX_PARTS : p;
}

/* Part p of `parts` of a request: its tokens [*a, *b), whole blocks from the window's. */
static void part_range(int64_t len, int64_t window, int64_t block_size, int64_t p,
                       int64_t parts, int64_t *a, int64_t *b) {
    int64_t b0;
    const int64_t blocks = window_blocks(len, window, block_size, &b0);
    *a = (b0 + blocks * p / parts) * block_size;
    const int64_t end = (b0 + blocks * (p + 1) / parts) * block_size;
    *b = end < len ? end : len;
}

/* Query head x of a request split into `parts` parts, each [nq][head_dim + 2]: the part's
 * unnormalised sums, then its rows' score max and softmax sum. Writes head_dim floats. */
static void merge_parts(const float *partial, int64_t parts, int64_t nq, int64_t head_dim,
                        int64_t x, float scale, float *out) {
    const int64_t stride = nq * (head_dim + 2);
    const float *acc0 = partial + x * head_dim, *max0 = partial + nq * head_dim + x;
    float m = max0[0], z = 0.0f;
    for (int64_t p = 1; p < parts; p++) m = max0[p * stride] > m ? max0[p * stride] : m;
    memset(out, 0, sizeof(float) * head_dim);
    for (int64_t p = 0; p < parts; p++) {
        const float c = expf((max0[p * stride] - m) * scale);
        z += c * max0[p * stride + nq];
        axpy(out, c, acc0 + p * stride, head_dim);
    }
    for (int64_t i = 0; i < head_dim; i++) out[i] /= z;
}

/* Returns 0, or -1 when scratch memory could not be allocated. */
#define DEFINE_DRIVER(NAME, T, ITEM, AVX2_ITEM, AVX512_ITEM, WIDEN_Q, STORE_OUT)              \
    int NAME(const T *q, int64_t q_row_stride, const T *cache, int64_t num_blocks,           \
             int64_t block_size, int64_t num_kv_heads, int64_t head_dim, int64_t tok_stride,  \
             int64_t head_stride, const int64_t *table, int64_t table_stride,                 \
             const int64_t *lens, int64_t num_reqs, int64_t group, float scale,               \
             int64_t window, int variant, T *out, int num_threads) {                          \
        if (variant < 0 || variant > KVF_AVX512 || !(KVF_VARIANTS & (1 << variant)))         \
            return -2;                                                                        \
        const int64_t longest = max_len(lens, num_reqs);                                      \
        /* Split: items are (request, part) over all heads; else (request, run of heads). */  \
        const int split = num_reqs < SPLIT_BELOW_REQS && head_stride == head_dim;             \
        const int64_t nh = split ? num_kv_heads                                               \
                                 : heads_per_item(num_reqs, num_kv_heads, head_dim,           \
                                                  head_stride, num_threads);                  \
        const int64_t per_kv = num_kv_heads / nh, nq = nh * group;                            \
        /* The widest items whose vectors tile head_dim. */                                  \
        const int level = variant == KVF_AVX512 && head_dim % 16 == 0 ? KVF_AVX512            \
                          : variant >= KVF_AVX2 && head_dim % 8 == 0  ? KVF_AVX2              \
                                                                      : KVF_SCALAR;           \
        int64_t starts[SPLIT_BELOW_REQS + 1] = {0}, items = num_reqs * per_kv;                \
        float *partial = NULL; /* per part: its acc, then its rows' max and sum */           \
        const int64_t part_floats = nq * (head_dim + 2);                                      \
        if (split) {                                                                          \
            for (int64_t r = 0; r < num_reqs; r++)                                            \
                starts[r + 1] = starts[r] + parts_of(lens[r], window, block_size);            \
            items = starts[num_reqs];                                                         \
            if (items > num_reqs) {                                                           \
                partial = malloc(sizeof(float) * items * part_floats);                        \
                if (partial == NULL) return -1;                                               \
            }                                                                                 \
        }                                                                                     \
        int failed = 0;                                                                       \
        _Pragma("omp parallel num_threads(num_threads) reduction(| : failed)") {              \
            float *scratch = malloc(sizeof(float) *                                           \
                                    (nq * (longest + 2 * head_dim + 2) + 4 * nh * head_dim)); \
            /* Every thread reaches the worksharing loops (one skipping them would hang the   \
             * others at a barrier); one without scratch only marks the call failed. */      \
            if (scratch == NULL) failed = 1;                                                  \
            float *scores = scratch, *acc = scores + nq * longest, *qf = acc + nq * head_dim; \
            float *gmax = qf + nq * head_dim, *gsum = gmax + nq, *rows = gsum + nq;           \
            _Pragma("omp for schedule(dynamic, 1)") for (int64_t item = 0; item < items;     \
                                                         item++) {                            \
                if (scratch == NULL) continue;                                                \
                int64_t r = item / per_kv, h0 = (item % per_kv) * nh, parts = 1, p = 0;       \
                if (split) {                                                                  \
                    r = 0;                                                                    \
                    while (starts[r + 1] <= item) r++;                                        \
                    parts = starts[r + 1] - starts[r], p = item - starts[r];                  \
                }                                                                             \
                int64_t a, b;                                                                 \
                part_range(lens[r], window, block_size, p, parts, &a, &b);                    \
                const T *qr = q + r * q_row_stride + h0 * group * head_dim;                   \
                float *part = parts > 1 ? partial + item * part_floats : NULL;                \
                (level == KVF_AVX512 ? AVX512_ITEM                                            \
                 : level == KVF_AVX2 ? AVX2_ITEM                                              \
                                     : ITEM)(WIDEN_Q(qr), cache, num_blocks, block_size,         \
                                          num_kv_heads, head_dim, tok_stride, head_stride,    \
                                          table + r * table_stride, lens[r], h0, nh, group,   \
                                          scale, window, a, b, scores, part ? part : acc,     \
                                          part ? part + nq * head_dim : NULL,                 \
                                          part ? part + nq * head_dim + nq : gsum, rows);     \
                if (!part)                                                                    \
                    STORE_OUT(out + (r * num_kv_heads + h0) * group * head_dim, acc,          \
                              nq * head_dim);                                                 \
            }                                                                                 \
            if (partial) {                                                                    \
                _Pragma("omp for schedule(static)") for (int64_t rx = 0; rx < num_reqs * nq;  \
                                                         rx++) {                              \
                    const int64_t r = rx / nq, x = rx % nq;                                   \
                    const int64_t parts = starts[r + 1] - starts[r];                          \
                    if (scratch == NULL || parts == 1) continue;                              \
                    merge_parts(partial + starts[r] * part_floats, parts, nq,                 \
                                head_dim, x, scale, acc);                                     \
                    STORE_OUT(out + (r * num_kv_heads * group + x) * head_dim, acc, head_dim); \
                }                                                                             \
            }                                                                                 \
            free(scratch);                                                                    \
        }                                                                                     \
        free(partial);                                                                        \
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
/* Bit v set: variant v (KVF_SCALAR, KVF_AVX2, KVF_AVX512) is in this build. */
int kvf_paged_decode_variants(void) { return KVF_VARIANTS; }

DEFINE_DRIVER(kvf_paged_decode_f32, float, item_f32, avx2_item_f32, avx512_item_f32, Q_F32,
              store_f32)
DEFINE_DRIVER(kvf_paged_decode_bf16, bf16_t, item_bf16, avx2_item_bf16, avx512_item_bf16, Q_BF16,
              store_bf16)
