/*
 * Causal prefill attention straight from the paged KV pool, for CPU engines.
 *
 * One request's chunk of `q_len` new tokens at positions ctx .. ctx + q_len - 1 attends to
 * the keys 0 .. its own position, read in place from the blocks named by its block-table row
 * (the chunk's own K/V already written there). Nothing is gathered and no mask is built: a
 * key tile past a query's position is skipped, and only the tiles on the diagonal mask.
 *
 * A query tile is a run of queries of one kv head: its rows are their (query, query head)
 * pairs, IROWS (64) of them, all sharing the kv head, so each key and value tile is loaded
 * once for all of them. Work items are up to QG consecutive query tiles of one kv head, which
 * take the head's keys in blocks of KB: each block is read from memory once and then served
 * from the core's L2 to every tile of the item (a head's keys and values for a few thousand
 * tokens are MiBs). Rows are the vector lanes, in register tiles of ROWS rows (RV vectors of
 * one register each: 16 rows with AVX2, 64 with AVX-512). Queries and the output
 * are kept transposed ([head_dim][ROWS] per register tile) for the whole item, so keys and
 * values are read in place as scalars, every product is a broadcast fused multiply-add
 * (micro-kernels of KS keys or KV value dims by RV vectors), and the online softmax
 * (running max and sum per row, keys in tiles of KT) is elementwise over row vectors:
 *   scores  S[KT][ROWS] = K . Qt      (Qt pre-scaled by scale * log2(e): P = 2^(S - max))
 *   values  Ot[:][ROWS] = Ot * alpha + V^T . P
 * A row's running max moves only when a tile's score passes it by more than MAX_SLACK, so
 * after the first tiles most tiles rescale nothing and the values skip the multiply by alpha.
 * Rows past the chunk's end are padding and never stored. With a sliding `window` (> 0) the
 * query at position p sees only keys p - window + 1 .. p: keys before all of an item's
 * queries' windows are never read (their blocks may be null blocks), and the tiles at the
 * window's edge mask like the diagonal ones. Accumulation is in fp32; bf16 keys and values
 * are widened once per key block and the output rounded to nearest even.
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
#define QG 8                /* query tiles per work item, at most */
#define KB (5 * KT)         /* keys per key block */
#define NEG (-1e30f) /* finite: -ffast-math assumes no infinities */
/* log2 units: probabilities up to 2^8 lose nothing in fp32 (the output is divided by the sum
 * of the same probabilities at the end). */
#define MAX_SLACK 8.0f

static inline vf vload(const float *p) {
    vf v;
    memcpy(&v, p, sizeof(v));
    return v;
}

static inline void vstore(float *p, vf v) { memcpy(p, &v, sizeof(v)); }

/* a where the lane of mask is set (all ones), else b. */
static inline vf vselect(vi mask, vf a, vf b) {
    vi ai, bi;
    memcpy(&ai, &a, sizeof(ai));
    memcpy(&bi, &b, sizeof(bi));
    vi r = (ai & mask) | (bi & ~mask);
    memcpy(&a, &r, sizeof(a));
    return a;
}

/* a > b ? a : b per lane, as the max instructions do. Built from vselect the compiler emits a
 * compare and two masked logic ops per call, and a tile's max over its keys is one chain of
 * them (about a tenth of the kernel's time on AVX-512). */
#if defined(__AVX512F__) && VW == 16
#include <immintrin.h>
static inline vf vmax(vf a, vf b) { return (vf)_mm512_max_ps((__m512)a, (__m512)b); }
#elif defined(__AVX__) && VW == 8
#include <immintrin.h>
static inline vf vmax(vf a, vf b) { return (vf)_mm256_max_ps((__m256)a, (__m256)b); }
#else
static inline vf vmax(vf a, vf b) { return vselect(a > b, a, b); }
#endif

#if defined(__AVX512F__) && VW == 16
#include "exp2_avx512.h"
/* 2^x for x <= MAX_SLACK to about 4 ulp; x below the fp32 range gives 0 or a subnormal. */
static inline vf vexp2(vf xv) {
    __m512 x;
    memcpy(&x, &xv, sizeof(x));
    const __m512 r = exp2_avx512(x, EXP2_DEGREE5, 6);
    vf rv;
    memcpy(&rv, &r, sizeof(rv));
    return rv;
}
#else
/* 2^x for x <= MAX_SLACK to about 2 ulp; x below the fp32 range gives exactly 0. */
static inline vf vexp2(vf x) {
    const vf lo = (vf){0} - 125.0f;
    vi under = x < lo;
    vf y = vmax(x, lo);
    /* n = floor(y + 0.5) by truncating a positive number (y >= -125); the polynomial covers f
     * in [-0.5, 1] should a rounding off by one at an exact half happen. */
    vf n = __builtin_convertvector(__builtin_convertvector(y + 128.5f, vi), vf) - 128.0f;
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

/* ot[e .. e + NB][:] = RESCALE(ot) + sum_j v[j][e ..] * p[j][:]: NB value dims at a time. */
#define VALUES_BLOCK(NB, RESCALE)                                                           \
    do {                                                                                    \
        vf a[NB][RV];                                                                       \
        for (int b = 0; b < NB; b++)                                                        \
            for (int v = 0; v < RV; v++) a[b][v] = RESCALE(vload(ot + (e + b) * ROWS + VW * v)); \
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

#define TIMES_ALPHA(x) ((x) * al[v])
#define AS_IS(x) (x)

/* alpha: each row's rescale, or NULL where no row's is other than 1. */
static void values_tile(const float *restrict p, const float *const *restrict val, int64_t n,
                        int64_t d, const float *restrict alpha, float *restrict ot) {
    int64_t e = 0;
    if (alpha != NULL) {
        vf al[RV];
        for (int v = 0; v < RV; v++) al[v] = vload(alpha + VW * v);
        for (; e + KV <= d; e += KV) VALUES_BLOCK(KV, TIMES_ALPHA);
        for (; e + 4 <= d; e += 4) VALUES_BLOCK(4, TIMES_ALPHA);
        for (; e < d; e += 2) VALUES_BLOCK(2, TIMES_ALPHA); /* head_dim is even */
    } else {
        for (; e + KV <= d; e += KV) VALUES_BLOCK(KV, AS_IS);
        for (; e + 4 <= d; e += 4) VALUES_BLOCK(4, AS_IS);
        for (; e < d; e += 2) VALUES_BLOCK(2, AS_IS);
    }
}

static inline int masked_key(int64_t t, int32_t lim, int64_t window) {
    return t > lim || (window > 0 && t <= lim - window);
}

/* Masks keys outside each row's range (row r may see keys t <= lim[r], and with a window
 * t > lim[r] - window), turns scores into probabilities and updates the running max m and
 * sum l; alpha gets each row's rescale, and the return value says whether any is other than 1.
 * A masked key's probability is exactly 0, also in a row whose keys in this tile are all
 * masked (its max is then NEG itself). */
static int softmax_tile(float *restrict s, int64_t n, int64_t t0, const int32_t *restrict lim,
                        int64_t window, int edge, float *restrict m, float *restrict l,
                        float *restrict alpha) {
    if (edge) {
        for (int64_t j = 0; j < n; j++) {
#pragma omp simd
            for (int r = 0; r < ROWS; r++)
                if (masked_key(t0 + j, lim[r], window)) s[j * ROWS + r] = NEG;
        }
    }
    int moved = 0;
    for (int v = 0; v < RV; v++) {
        /* Two chains of maxima, so that each max waits on the one two keys back. */
        vf mo = vload(m + VW * v), tm = vload(s + VW * v), tm2 = tm;
        int64_t j = 1;
        for (; j + 1 < n; j += 2) {
            tm = vmax(tm, vload(s + j * ROWS + VW * v));
            tm2 = vmax(tm2, vload(s + (j + 1) * ROWS + VW * v));
        }
        if (j < n) tm = vmax(tm, vload(s + j * ROWS + VW * v));
        tm = vmax(tm, tm2);
        /* NEG + MAX_SLACK == NEG: a row's first visible score always moves its max. */
        const vi up = tm > mo + MAX_SLACK;
        int any = 0;
        for (int r = 0; r < VW; r++) any |= up[r] & 1;
        const vf mx = any ? vselect(up, tm, mo) : mo;
        vf z = {0};
        const int window_edge = edge && window > 0;
        for (int64_t j = 0; j < n; j++) {
            vf pj = vexp2(vload(s + j * ROWS + VW * v) - mx);
            vstore(s + j * ROWS + VW * v, pj);
            if (!window_edge) z += pj;
        }
        if (window_edge) {
            for (int64_t j = 0; j < n; j++)
                for (int r = VW * v; r < VW * v + VW; r++)
                    if (masked_key(t0 + j, lim[r], window)) s[j * ROWS + r] = 0.0f;
            for (int64_t j = 0; j < n; j++) z += vload(s + j * ROWS + VW * v);
        }
        const vf one = (vf){0} + 1.0f;
        /* Rows whose max stays get exactly 1 (2^0 through the polynomial need not be). */
        const vf a = any ? vselect(up, vexp2(mo - mx), one) : one;
        moved |= any;
        vstore(alpha + VW * v, a);
        vstore(m + VW * v, mx);
        vstore(l + VW * v, vload(l + VW * v) * a + z);
    }
    return moved;
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

/* Per-thread scratch, all fp32. An item's rows are QG query tiles' (query, head) pairs,
 * IROWS of them per query tile, in IROWS / ROWS register tiles; each tile's arrays are
 * contiguous. */
typedef struct {
    float *qt;    /* [QG][IROWS / ROWS][d][ROWS] scaled queries, transposed */
    float *ot;    /* [QG][IROWS / ROWS][d][ROWS] unnormalised output, transposed */
    float *s;     /* [KT][ROWS] scores, then probabilities (one tile at a time) */
    float *m, *l, *alpha; /* [QG][IROWS] running max, running sum, this tile's rescale */
    float *kb, *vb;       /* [KB][d] widened keys and values of a key block (bf16 only) */
    int32_t *lim;         /* [QG][IROWS] last key position each row may see */
    const float **kp, **vp; /* [KB] the key block's key and value rows */
} scratch_t;

/* Query heads one work item can stack: the most a kv head may have. */
int kvf_paged_prefill_rows(void) { return IROWS; }

/* One query tile of an item: its first query, its query count and the key range it reads. */
typedef struct {
    int64_t q0, nq, rows, rts; /* rts: register tiles in use */
    int64_t lim0, kstart, kend, lo_edge;
} qtile_t;

static qtile_t query_tile(int64_t tile, int64_t qt_n, int64_t q_len, int64_t group, int64_t ctx,
                          int64_t window) {
    qtile_t t;
    t.q0 = tile * qt_n;
    t.nq = q_len - t.q0 < qt_n ? q_len - t.q0 : qt_n;
    t.rows = t.nq * group;
    t.rts = (t.rows + ROWS - 1) / ROWS;
    t.lim0 = ctx + t.q0;
    t.kend = t.lim0 + t.nq;
    /* With a window: the first key the tile's first query sees, and the last key position
     * its last query cannot see any more. */
    t.kstart = window > 0 && t.lim0 >= window ? t.lim0 - window + 1 : 0;
    t.lo_edge = window > 0 ? t.kend - window : -1;
    return t;
}

/* Keys kb0 .. kb0 + kn - 1 of query tile qt's range (they lie in the key block), register
 * tile by register tile. */
static void attend_block(const scratch_t *w, int64_t i, const qtile_t *qt, int64_t kb0,
                         int64_t kn, int64_t d, int64_t window) {
    const int64_t lo = kb0 > qt->kstart ? kb0 : qt->kstart;
    const int64_t hi = kb0 + kn < qt->kend ? kb0 + kn : qt->kend;
    for (int64_t t0 = lo; t0 < hi; t0 += KT) {
        const int64_t n = hi - t0 < KT ? hi - t0 : KT;
        const int edge = t0 + n - 1 > qt->lim0 || t0 < qt->lo_edge;
        for (int64_t rt = 0; rt < qt->rts; rt++) {
            const int64_t o = i * IROWS + rt * ROWS;
            scores_tile(w->qt + o * d, w->kp + (t0 - kb0), n, d, w->s);
            const int moved = softmax_tile(w->s, n, t0, w->lim + o, window, edge, w->m + o,
                                           w->l + o, w->alpha + o);
            values_tile(w->s, w->vp + (t0 - kb0), n, d, moved ? w->alpha + o : NULL,
                        w->ot + o * d);
        }
    }
}

/* Work items are (kv head, QG consecutive query tiles): the tiles take each key block of KB
 * keys in turn while it is in the core's L2 (a head's keys and values for a long sequence are
 * MiBs, read from memory once per item rather than once per query tile). */
#define DEFINE_PREFILL(NAME, T, TO_F32, FROM_F32)                                             \
    /* Query tile i of the item (query tile qt, kv head h) into the scratch. */               \
    static void NAME##_queries_in(scratch_t *w, int64_t i, const qtile_t *qt, const T *q,     \
                                  int64_t q_row_stride, int64_t h, int64_t group, int64_t d,  \
                                  float scale, int fast) {                                    \
        const float *rsrc[16];                                                                \
        float *qt0 = w->qt + i * IROWS * d;                                                   \
        for (int64_t r = 0; r < qt->rts * ROWS; r++) {                                        \
            const int64_t qi = r < qt->rows ? r / group : 0;                                  \
            const T *src = q + (qt->q0 + qi) * q_row_stride + (h * group + r % group) * d;    \
            if (!fast) {                                                                      \
                float *dst = qt0 + (r / ROWS) * d * ROWS + r % ROWS;                          \
                for (int64_t e = 0; e < d; e++) dst[e * ROWS] = TO_F32(src[e]) * scale;       \
            } else {                                                                          \
                rsrc[r % 16] = (const float *)(const void *)src;                              \
                if (r % 16 == 15)                                                             \
                    q_in16(qt0 + (r / ROWS) * d * ROWS + (r - 15) % ROWS, rsrc, d, scale);    \
            }                                                                                 \
            w->m[i * IROWS + r] = NEG;                                                        \
            w->l[i * IROWS + r] = 0.0f;                                                       \
            w->lim[i * IROWS + r] = (int32_t)(qt->lim0 + qi);                                 \
        }                                                                                     \
        memset(w->ot + i * IROWS * d, 0, sizeof(float) * d * ROWS * qt->rts);                 \
    }                                                                                         \
                                                                                              \
    /* Query tile i's rows, normalised, into out. */                                         \
    static void NAME##_out(const scratch_t *w, int64_t i, const qtile_t *qt, T *out,          \
                           int64_t h, int64_t group, int64_t heads, int64_t d, int fast) {    \
        const float *ot0 = w->ot + i * IROWS * d, *l0 = w->l + i * IROWS;                     \
        for (int64_t r = 0; r < qt->rows && !fast; r++) {                                     \
            T *dst = out + ((qt->q0 + r / group) * heads + h * group + r % group) * d;        \
            const float *ot = ot0 + (r / ROWS) * d * ROWS + r % ROWS;                         \
            const float inv = 1.0f / l0[r];                                                   \
            for (int64_t e = 0; e < d; e++) dst[e] = FROM_F32(ot[e * ROWS] * inv);            \
        }                                                                                     \
        for (int64_t r0 = 0; r0 < qt->rows && fast; r0 += 16) {                               \
            float *rdst[16];                                                                  \
            const int n = qt->rows - r0 < 16 ? (int)(qt->rows - r0) : 16;                     \
            for (int j = 0; j < n; j++) {                                                     \
                const int64_t r = r0 + j;                                                     \
                rdst[j] = (float *)(void *)(out + ((qt->q0 + r / group) * heads + h * group + \
                                                   r % group) * d);                           \
            }                                                                                 \
            out16(rdst, n, ot0 + (r0 / ROWS) * d * ROWS + r0 % ROWS, l0 + r0, d);             \
        }                                                                                     \
    }                                                                                         \
                                                                                              \
    int NAME(const T *q, int64_t q_row_stride, const T *cache, int64_t num_blocks,           \
             int64_t block_size, int64_t num_kv_heads, int64_t d, int64_t tok_stride,        \
             int64_t head_stride, const int64_t *table,                                       \
             int64_t ctx, int64_t q_len, int64_t group, float scale, int64_t window, T *out,  \
             int num_threads) {                                                               \
        const int64_t block_elems = block_size * num_kv_heads * d;                            \
        const T *vals = cache + num_blocks * block_elems;                                     \
        const int64_t qt_n = IROWS / group > 0 ? IROWS / group : 1; /* queries per tile */    \
        const int64_t tiles = (q_len + qt_n - 1) / qt_n, heads = num_kv_heads * group;      \
        /* Fewer query tiles per item where there would be too few items to share out. */    \
        int64_t qg = QG;                                                                      \
        while (qg > 1 && (tiles + qg - 1) / qg * num_kv_heads < 4 * num_threads) qg /= 2;     \
        const int64_t groups = (tiles + qg - 1) / qg, items = groups * num_kv_heads;         \
        /* fp32 rows through 16 x 16 register transposes (AVX-512, head_dim a multiple of 16). */ \
        const int fast = FAST_T16 && sizeof(T) == sizeof(float) && d % 16 == 0;              \
        int failed = 0;                                                                       \
        scale *= 1.44269504088896341f; /* log2(e): the softmax takes 2^(s - max) */           \
        if (group > IROWS) return -2;                                                         \
        _Pragma("omp parallel num_threads(num_threads) reduction(| : failed)") {              \
            scratch_t w;                                                                      \
            float *buf = aligned_alloc(64, sizeof(float) * (2 * QG * d * IROWS + KT * ROWS +  \
                                                            4 * QG * IROWS + 2 * KB * d) +    \
                                               2 * KB * sizeof(float *));                     \
            if (buf == NULL) failed = 1;                                                      \
            w.qt = buf;                                                                       \
            w.ot = w.qt + QG * d * IROWS;                                                     \
            w.s = w.ot + QG * d * IROWS;                                                      \
            w.m = w.s + KT * ROWS;                                                            \
            w.l = w.m + QG * IROWS;                                                           \
            w.alpha = w.l + QG * IROWS;                                                       \
            w.lim = (int32_t *)(w.alpha + QG * IROWS);                                        \
            w.kb = w.alpha + 2 * QG * IROWS;                                                  \
            w.vb = w.kb + KB * d;                                                             \
            w.kp = (const float **)(void *)(w.vb + KB * d);                                   \
            w.vp = w.kp + KB;                                                                 \
            /* Later query tiles see more keys: hand them out first. */                       \
            _Pragma("omp for schedule(dynamic, 1)") for (int64_t it = 0; it < items; it++) { \
                if (buf == NULL) continue;                                                    \
                const int64_t tile0 = (groups - 1 - it / num_kv_heads) * qg;                  \
                const int64_t h = it % num_kv_heads;                                          \
                const int64_t ntiles = tiles - tile0 < qg ? tiles - tile0 : qg;              \
                qtile_t qts[QG] = {{0}};                                                      \
                for (int64_t i = 0; i < ntiles; i++) {                                        \
                    qts[i] = query_tile(tile0 + i, qt_n, q_len, group, ctx, window);          \
                    NAME##_queries_in(&w, i, &qts[i], q, q_row_stride, h, group, d, scale,    \
                                      fast);                                                  \
                }                                                                             \
                /* The first tile's first key is the item's first (windows move forward). */  \
                const int64_t kfirst = qts[0].kstart, klast = qts[ntiles - 1].kend;           \
                for (int64_t kb0 = kfirst; kb0 < klast; kb0 += KB) {                          \
                    const int64_t kn = klast - kb0 < KB ? klast - kb0 : KB;                   \
                    for (int64_t j = 0; j < kn; j++) {                                        \
                        const int64_t t = kb0 + j;                                            \
                        const int64_t off = table[t / block_size] * block_elems +             \
                                            (t % block_size) * tok_stride + h * head_stride;  \
                        if (sizeof(T) == sizeof(float)) {                                     \
                            w.kp[j] = (const float *)(const void *)(cache + off);             \
                            w.vp[j] = (const float *)(const void *)(vals + off);              \
                        } else {                                                              \
                            for (int64_t e = 0; e < d; e++) {                                 \
                                w.kb[j * d + e] = TO_F32(cache[off + e]);                     \
                                w.vb[j * d + e] = TO_F32(vals[off + e]);                      \
                            }                                                                 \
                            w.kp[j] = w.kb + j * d;                                           \
                            w.vp[j] = w.vb + j * d;                                           \
                        }                                                                     \
                    }                                                                         \
                    for (int64_t i = 0; i < ntiles; i++)                                      \
                        attend_block(&w, i, &qts[i], kb0, kn, d, window);                     \
                }                                                                             \
                for (int64_t i = 0; i < ntiles; i++)                                          \
                    NAME##_out(&w, i, &qts[i], out, h, group, heads, d, fast);                \
            }                                                                                 \
            free(buf);                                                                        \
        }                                                                                     \
        return failed ? -1 : 0;                                                               \
    }

#define ID(x) (x)
DEFINE_PREFILL(kvf_paged_prefill_f32, float, ID, ID)
DEFINE_PREFILL(kvf_paged_prefill_bf16, bf16_t, bf16_to_f32, f32_to_bf16)
