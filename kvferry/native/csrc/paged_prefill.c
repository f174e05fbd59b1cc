/*
 * Causal prefill attention straight from the paged KV pool, for CPU engines.
 *
 * One request's chunk of `q_len` new tokens at positions ctx .. ctx + q_len - 1 attends to
 * the keys 0 .. its own position, read in place from the blocks named by its block-table row
 * (the chunk's own K/V already written there). Nothing is gathered and no mask is built: a
 * key tile past a query's position is skipped, and only the tiles on the diagonal mask.
 *
 * Work items are (kv head, run of queries); the item's rows are its (query, query head)
 * pairs, IROWS (64) of them, all sharing the kv head, so each key and value tile is loaded
 * once for all of them. Rows are the vector lanes, in register tiles of ROWS rows (RV
 * vectors of one register each: 16 rows with AVX2, 64 with AVX-512). Queries and the output
 * are kept transposed ([head_dim][ROWS] per register tile) for the whole item, so keys and
 * values are read in place as scalars, every product is a broadcast fused multiply-add
 * (micro-kernels of KS keys or KV value dims by RV vectors), and the online softmax
 * (running max and sum per row, keys in tiles of KT) is elementwise over row vectors:
 *   scores  S[KT][ROWS] = K . Qt      (Qt pre-scaled)
 *   values  Ot[:][ROWS] = Ot * alpha + V^T . P
 * Rows past the chunk's end are padding and never stored. With a sliding `window` (> 0) the
 * query at position p sees only keys p - window + 1 .. p: key tiles wholly before an item's
 * queries' windows are never read (their blocks may be null blocks), and the tiles at the
 * window's edge mask like the diagonal ones. Accumulation is in fp32; bf16
 * keys and values are widened one tile at a time and the output rounded to nearest even.
 *
 * Layouts:
 *   q      [q_len, num_heads, head_dim], row t at q + t * q_row_stride, heads contiguous
 *   cache  [2, num_blocks, block_size, num_kv_heads, head_dim] (keys, then values); inside a
 *          block, token t's head h starts at t * tok_stride + h * head_stride (NHD or HND
 *          order; blocks are block_size * num_kv_heads * head_dim apart either way)
 *   table  block ids of the request, covering ctx + q_len tokens
 *   out    [q_len, num_heads, head_dim], contiguous
 * head_dim must be even; group (query heads per kv head) at most IROWS.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
/* A row vector is one machine register: with 16 registers of 8 floats (AVX2), tiles of
 * 16-float vectors spill their accumulators on every FMA and run >10x slower. */
/* KVF_WIDE_TILES: the AVX-512 tiles anywhere (the compiler splits the vectors), so a CPU
 * without AVX-512 can test that configuration. */
#if defined(__AVX512F__) || defined(KVF_WIDE_TILES)
#define VW 16 /* floats per row vector */
#define RV 4  /* row vectors per register tile */
#else
#define VW 8
#define RV 2
#endif
typedef float vf __attribute__((vector_size(VW * 4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));

#define ROWS (VW * RV)      /* rows of one register tile */
#define IROWS 64            /* rows of one work item */
#define KT 24               /* keys per tile */
#define KS 6                /* keys per scores micro-kernel: KS x RV accumulators */
#define KV 6                /* value dims per values micro-kernel */
#define NEG (-1e30f) /* finite: -ffast-math assumes no infinities */

static inline vf vload(const float *p) {
    vf v;
    memcpy(&v, p, sizeof(v));
    return v;
}

static inline void vstore(float *p, vf v) { memcpy(p, &v, sizeof(v)); }

static inline vf vmax(vf a, vf b) {
    vi gt = a > b;
    vi ai, bi;
    memcpy(&ai, &a, sizeof(ai));
    memcpy(&bi, &b, sizeof(bi));
    vi r = (ai & gt) | (bi & ~gt);
    memcpy(&a, &r, sizeof(a));
    return a;
}

#if defined(__AVX512F__) && VW == 16
#include "exp2_avx512.h"
/* exp(x) for x <= 0 to about 2 ulp; x below the fp32 range gives 0 or a subnormal. */
static inline vf vexp(vf xv) {
    __m512 x;
    memcpy(&x, &xv, sizeof(x));
    const __m512 r = exp2_avx512(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                 EXP2_DEGREE6, 7);
    vf rv;
    memcpy(&rv, &r, sizeof(rv));
    return rv;
}
#else
/* exp(x) for x <= 0 to about 2 ulp; x below the fp32 range gives exactly 0. */
static inline vf vexp(vf x) {
    const vf lo = (vf){0} - 87.0f;
    vi under = x < lo;
    x = vmax(x, lo);
    vf y = x * 1.44269504088896341f;
    vf n = __builtin_convertvector(__builtin_convertvector(y - 0.5f, vi), vf);
    /* round-to-nearest of y via truncation of y - 0.5 (y <= 0) can be off by one at exact
     * halves; the polynomial covers f in [-0.5, 1] either way. */
    vf f = y - n;
    vf p = (vf){0} + 1.5353362e-4f;
    p = p * f + 1.3398874e-3f;
    p = p * f + 9.6181291e-3f;
    p = p * f + 5.5504109e-2f;
    p = p * f + 2.4022650e-1f;
    p = p * f + 6.9314718e-1f;
    p = p * f + 1.0f;
    vi e = (__builtin_convertvector(n, vi) + 127) << 23;
    vf scale;
    memcpy(&scale, &e, sizeof(scale));
    vf r = p * scale;
    vi ri;
    memcpy(&ri, &r, sizeof(ri));
    ri &= ~under;
    memcpy(&r, &ri, sizeof(r));
    return r;
}
#endif

/* s[j][:] = k[j] . qt for j < n (k rows ks apart; scores for j >= n are left unset). */
static void scores_tile(const float *restrict qt, const float *const *restrict k, int64_t n,
                        int64_t d, float *restrict s) {
    int64_t j = 0;
    for (; j + KS <= n; j += KS) {
        vf a[KS][RV] = {{{0}}};
        for (int64_t i = 0; i < d; i++) {
            vf q[RV];
            for (int v = 0; v < RV; v++) q[v] = vload(qt + i * ROWS + VW * v);
            for (int b = 0; b < KS; b++) {
                const float kb = k[j + b][i];
                for (int v = 0; v < RV; v++) a[b][v] += kb * q[v];
            }
        }
        for (int b = 0; b < KS; b++)
            for (int v = 0; v < RV; v++) vstore(s + (j + b) * ROWS + VW * v, a[b][v]);
    }
    for (; j < n; j++) {
        vf a[RV] = {{0}};
        for (int64_t i = 0; i < d; i++) {
            const float kb = k[j][i];
            for (int v = 0; v < RV; v++) a[v] += kb * vload(qt + i * ROWS + VW * v);
        }
        for (int v = 0; v < RV; v++) vstore(s + j * ROWS + VW * v, a[v]);
    }
}

/* ot[e .. e + NB][:] = ot * alpha + sum_j v[j][e ..] * p[j][:]: NB value dims at a time. */
#define VALUES_BLOCK(NB)                                                                    \
    do {                                                                                    \
        vf a[NB][RV];                                                                       \
        for (int b = 0; b < NB; b++)                                                        \
            for (int v = 0; v < RV; v++) a[b][v] = vload(ot + (e + b) * ROWS + VW * v) * al[v]; \
        for (int64_t j = 0; j < n; j++) {                                                   \
            vf pj[RV];                                                                      \
            for (int v = 0; v < RV; v++) pj[v] = vload(p + j * ROWS + VW * v);              \
            const float *vj = val[j] + e;                                                   \
            for (int b = 0; b < NB; b++)                                                    \
                for (int v = 0; v < RV; v++) a[b][v] += vj[b] * pj[v];                      \
        }                                                                                   \
        for (int b = 0; b < NB; b++)                                                        \
            for (int v = 0; v < RV; v++) vstore(ot + (e + b) * ROWS + VW * v, a[b][v]);     \
    } while (0)

static void values_tile(const float *restrict p, const float *const *restrict val, int64_t n,
                        int64_t d, const float *restrict alpha, float *restrict ot) {
    vf al[RV];
    for (int v = 0; v < RV; v++) al[v] = vload(alpha + VW * v);
    int64_t e = 0;
    for (; e + KV <= d; e += KV) VALUES_BLOCK(KV);
    for (; e + 4 <= d; e += 4) VALUES_BLOCK(4);
    for (; e < d; e += 2) VALUES_BLOCK(2); /* head_dim is even */
}

static inline int masked_key(int64_t t, int32_t lim, int64_t window) {
    return t > lim || (window > 0 && t <= lim - window);
}

/* Masks keys outside each row's range (row r may see keys t <= lim[r], and with a window
 * t > lim[r] - window), turns scores into probabilities and updates the running max m and
 * sum l; alpha gets each row's rescale. A masked key's probability is exactly 0, also in a
 * row whose keys in this tile are all masked (its max is then NEG itself). */
static void softmax_tile(float *restrict s, int64_t n, int64_t t0, const int32_t *restrict lim,
                         int64_t window, int edge, float *restrict m, float *restrict l,
                         float *restrict alpha) {
    if (edge) {
        for (int64_t j = 0; j < n; j++) {
#pragma omp simd
            for (int r = 0; r < ROWS; r++)
                if (masked_key(t0 + j, lim[r], window)) s[j * ROWS + r] = NEG;
        }
    }
    for (int v = 0; v < RV; v++) {
        vf mo = vload(m + VW * v), mx = mo;
        for (int64_t j = 0; j < n; j++) mx = vmax(mx, vload(s + j * ROWS + VW * v));
        vf z = {0};
        const int window_edge = edge && window > 0;
        for (int64_t j = 0; j < n; j++) {
            vf pj = vexp(vload(s + j * ROWS + VW * v) - mx);
            vstore(s + j * ROWS + VW * v, pj);
            if (!window_edge) z += pj;
        }
        if (window_edge) {
            for (int64_t j = 0; j < n; j++)
                for (int r = VW * v; r < VW * v + VW; r++)
                    if (masked_key(t0 + j, lim[r], window)) s[j * ROWS + r] = 0.0f;
            for (int64_t j = 0; j < n; j++) z += vload(s + j * ROWS + VW * v);
        }
        vf a = vexp(mo - mx);
        vstore(alpha + VW * v, a);
        vstore(m + VW * v, mx);
        vstore(l + VW * v, vload(l + VW * v) * a + z);
    }
}

/* fp32 queries in and outputs out of the transposed tiles, 16 rows by 16 dims at a time: a
 * 16 x 16 transpose in registers instead of a scalar load and store per element (which took
 * about a tenth of the kernel's time on 512-token prompts). AVX-512 only; elsewhere the
 * scalar loops serve. */
#if defined(__AVX512F__) && VW == 16
#include "transpose16.h"
#define FAST_T16 1
/* qt[e * ROWS + i] = src[i][e] * scale for 16 rows i (qt: a tile's first row of the 16). */
static void q_in16(float *qt, const float *const *src, int64_t d, float scale) {
    const __m512 sc = _mm512_set1_ps(scale);
    for (int64_t e0 = 0; e0 < d; e0 += 16) {
        __m512i v[16];
        for (int i = 0; i < 16; i++) v[i] = _mm512_loadu_si512((const void *)(src[i] + e0));
        transpose16(v);
        for (int j = 0; j < 16; j++)
            _mm512_storeu_ps(qt + (e0 + j) * ROWS, _mm512_mul_ps(_mm512_castsi512_ps(v[j]), sc));
    }
}

/* dst[i][e] = ot[e * ROWS + i] / l[i] for the first n of 16 rows. */
static void out16(float *const *dst, int n, const float *ot, const float *l, int64_t d) {
    for (int64_t e0 = 0; e0 < d; e0 += 16) {
        __m512i v[16];
        for (int j = 0; j < 16; j++)
            v[j] = _mm512_loadu_si512((const void *)(ot + (e0 + j) * ROWS));
        transpose16(v);
        for (int i = 0; i < n; i++)
            _mm512_storeu_ps(dst[i] + e0, _mm512_mul_ps(_mm512_castsi512_ps(v[i]),
                                                        _mm512_set1_ps(1.0f / l[i])));
    }
}
#else
#define FAST_T16 0
static void q_in16(float *qt, const float *const *src, int64_t d, float scale) {
    (void)qt, (void)src, (void)d, (void)scale;
}
static void out16(float *const *dst, int n, const float *ot, const float *l, int64_t d) {
    (void)dst, (void)n, (void)ot, (void)l, (void)d;
}
#endif

/* Per-thread scratch, all fp32. Rows are (query, head) pairs of the item, IROWS of them in
 * IROWS / ROWS register tiles; each tile's arrays are contiguous. */
typedef struct {
    float *qt;    /* [IROWS / ROWS][d][ROWS] scaled queries, transposed */
    float *ot;    /* [IROWS / ROWS][d][ROWS] unnormalised output, transposed */
    float *s;     /* [KT][ROWS] scores, then probabilities (one tile at a time) */
    float *m, *l, *alpha; /* [IROWS] running max, running sum, this tile's rescale */
    float *kb, *vb;       /* [KT][d] widened key and value tiles (bf16 only) */
    int32_t *lim;         /* [IROWS] last key position each row may see */
} scratch_t;

/* Query heads one work item can stack: the most a kv head may have. */
int kvf_paged_prefill_rows(void) { return IROWS; }

#define DEFINE_PREFILL(NAME, T, TO_F32, FROM_F32)                                             \
    int NAME(const T *q, int64_t q_row_stride, const T *cache, int64_t num_blocks,           \
             int64_t block_size, int64_t num_kv_heads, int64_t d, int64_t tok_stride,        \
             int64_t head_stride, const int64_t *table,                                       \
             int64_t ctx, int64_t q_len, int64_t group, float scale, int64_t window, T *out,  \
             int num_threads) {                                                               \
        const int64_t block_elems = block_size * num_kv_heads * d;                            \
        const T *vals = cache + num_blocks * block_elems;                                     \
        const int64_t qt_n = IROWS / group > 0 ? IROWS / group : 1; /* queries per item */    \
        const int64_t tiles = (q_len + qt_n - 1) / qt_n, items = tiles * num_kv_heads;       \
        const int64_t heads = num_kv_heads * group;                                           \
        /* fp32 rows through 16 x 16 register transposes (AVX-512, head_dim a multiple of 16). */ \
        const int fast = FAST_T16 && sizeof(T) == sizeof(float) && d % 16 == 0;              \
        int failed = 0;                                                                       \
        if (group > IROWS) return -2;                                                         \
        _Pragma("omp parallel num_threads(num_threads) reduction(| : failed)") {              \
            scratch_t w;                                                                      \
            const float *rsrc[16];                                                            \
            float *buf = aligned_alloc(64, sizeof(float) * (2 * d * IROWS + KT * ROWS +       \
                                                            4 * IROWS + 2 * KT * d));         \
            if (buf == NULL) failed = 1;                                                      \
            w.qt = buf;                                                                       \
            w.ot = w.qt + d * IROWS;                                                          \
            w.s = w.ot + d * IROWS;                                                           \
            w.m = w.s + KT * ROWS;                                                            \
            w.l = w.m + IROWS;                                                                \
            w.alpha = w.l + IROWS;                                                            \
            w.lim = (int32_t *)(w.alpha + IROWS);                                             \
            w.kb = w.alpha + 2 * IROWS;                                                       \
            w.vb = w.kb + KT * d;                                                             \
            /* Later query tiles see more keys: hand them out first. */                       \
            _Pragma("omp for schedule(dynamic, 1)") for (int64_t it = 0; it < items; it++) { \
                if (buf == NULL) continue;                                                    \
                const int64_t tile = tiles - 1 - it / num_kv_heads, h = it % num_kv_heads;   \
                const int64_t q0 = tile * qt_n;                                               \
                const int64_t nq = q_len - q0 < qt_n ? q_len - q0 : qt_n, rows = nq * group;  \
                const int64_t rts = (rows + ROWS - 1) / ROWS; /* register tiles in use */     \
                for (int64_t r = 0; r < rts * ROWS; r++) {                                    \
                    const int64_t qi = r < rows ? r / group : 0;                              \
                    const T *src = q + (q0 + qi) * q_row_stride + (h * group + r % group) * d; \
                    if (!fast) {                                                              \
                        float *qt = w.qt + (r / ROWS) * d * ROWS + r % ROWS;                  \
                        for (int64_t e = 0; e < d; e++) qt[e * ROWS] = TO_F32(src[e]) * scale; \
                    } else {                                                                  \
                        rsrc[r % 16] = (const float *)(const void *)src;                      \
                        if (r % 16 == 15)                                                     \
                            q_in16(w.qt + (r / ROWS) * d * ROWS + (r - 15) % ROWS, rsrc, d,   \
                                   scale);                                                    \
                    }                                                                         \
                    w.m[r] = NEG;                                                             \
                    w.l[r] = 0.0f;                                                            \
                    w.lim[r] = (int32_t)(ctx + q0 + qi);                                      \
                }                                                                             \
                memset(w.ot, 0, sizeof(float) * d * ROWS * rts);                              \
                const int64_t lim0 = ctx + q0, kend = ctx + q0 + nq;                          \
                /* With a window: the first key the item's first query sees, and the last     \
                 * key position its last query cannot see any more. */                        \
                const int64_t kstart = window > 0 && lim0 >= window ? lim0 - window + 1 : 0;  \
                const int64_t lo_edge = window > 0 ? kend - window : -1;                      \
                for (int64_t t0 = kstart; t0 < kend; t0 += KT) {                              \
                    const int64_t n = kend - t0 < KT ? kend - t0 : KT;                        \
                    const float *krow[KT], *vrow[KT];                                         \
                    for (int64_t j = 0; j < n; j++) {                                         \
                        const int64_t t = t0 + j;                                             \
                        const int64_t off = table[t / block_size] * block_elems +             \
                                            (t % block_size) * tok_stride + h * head_stride;  \
                        if (sizeof(T) == sizeof(float)) {                                     \
                            krow[j] = (const float *)(const void *)(cache + off);             \
                            vrow[j] = (const float *)(const void *)(vals + off);              \
                        } else {                                                              \
                            for (int64_t e = 0; e < d; e++) {                                 \
                                w.kb[j * d + e] = TO_F32(cache[off + e]);                     \
                                w.vb[j * d + e] = TO_F32(vals[off + e]);                      \
                            }                                                                 \
                            krow[j] = w.kb + j * d;                                           \
                            vrow[j] = w.vb + j * d;                                           \
                        }                                                                     \
                    }                                                                         \
                    const int edge = t0 + n - 1 > lim0 || t0 < lo_edge;                       \
                    for (int64_t rt = 0; rt < rts; rt++) {                                    \
                        const int64_t o = rt * ROWS;                                          \
                        scores_tile(w.qt + o * d, krow, n, d, w.s);                           \
                        softmax_tile(w.s, n, t0, w.lim + o, window, edge, w.m + o, w.l + o,   \
                                     w.alpha + o);                                            \
                        values_tile(w.s, vrow, n, d, w.alpha + o, w.ot + o * d);              \
                    }                                                                         \
                }                                                                             \
                for (int64_t r = 0; r < rows && !fast; r++) {                                \
                    T *dst = out + ((q0 + r / group) * heads + h * group + r % group) * d;    \
                    const float *ot = w.ot + (r / ROWS) * d * ROWS + r % ROWS;                \
                    const float inv = 1.0f / w.l[r];                                          \
                    for (int64_t e = 0; e < d; e++) dst[e] = FROM_F32(ot[e * ROWS] * inv);    \
                }                                                                             \
                for (int64_t r0 = 0; r0 < rows && fast; r0 += 16) {                           \
                    float *rdst[16];                                                          \
                    const int n = rows - r0 < 16 ? (int)(rows - r0) : 16;                     \
                    for (int i = 0; i < n; i++) {                                             \
                        const int64_t r = r0 + i;                                             \
                        rdst[i] = (float *)(void *)(out + ((q0 + r / group) * heads +         \
                                                           h * group + r % group) * d);       \
                    }                                                                         \
                    out16(rdst, n, w.ot + (r0 / ROWS) * d * ROWS + r0 % ROWS, w.l + r0, d);   \
                }                                                                             \
            }                                                                                 \
            free(buf);                                                                        \
        }                                                                                     \
        return failed ? -1 : 0;                                                               \
    }

#define ID(x) (x)
DEFINE_PREFILL(kvf_paged_prefill_f32, float, ID, ID)
DEFINE_PREFILL(kvf_paged_prefill_bf16, bf16_t, bf16_to_f32, f32_to_bf16)
