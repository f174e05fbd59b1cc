/*
 * Causal prefill attention straight from a bf16 paged KV pool, on AMX tiles.
 *
 * The same contract as paged_prefill.c (one request's chunk of q_len new tokens at positions
 * ctx .. ctx + q_len - 1 attends to keys 0 .. its own position, optionally within a sliding
 * window), for bf16 only and with bf16 products: scores Q.K^T and the output P.V are tile
 * products (bf16 operands, fp32 sums); the online softmax runs in fp32 on AVX-512, and the
 * probabilities are rounded to bf16 before they meet the values, as torch's flash attention
 * does for bf16.
 *
 * First, per kv head, the sequence's keys and values are laid out once in the tiles' pair
 * order (zeros past the sequence and before every query's window):
 *   kt  [key tiles of 16][head_dim / 2 pairs][16 keys][2]   (right operand of Q.K^T)
 *   vv  [key pairs][head_dim][2]                            (right operand of P.V)
 * Then each work item (kv head, run of queries) stacks its (query, query head) rows, ROWS
 * (32) of them, as the left operand, and walks the keys in blocks of up to KB (128): scores
 * for the block on tiles, the rows' running max and sum updated and their probabilities
 * written as bf16, then the output's tiles (fp32, in memory: rows x head_dim) rescaled and
 * accumulated. Key blocks past an item's last query and before its first query's window are
 * never computed; keys past a row's position (or before its window) get probability 0.
 *
 * Layouts as in paged_prefill.c; head_dim a multiple of 32, at most 256; group (query heads
 * per kv head) at most ROWS. `layout` is the caller's buffer for kt and vv:
 * kvf_paged_prefill_amx_layout_elems(seq, d, num_kv_heads) bf16 elements, 64-byte aligned
 * (reused across calls: a fresh one per call would be paged in every time).
 */
#define _DEFAULT_SOURCE /* syscall(), for the request for the tile state */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "bf16.h"
#include "exp2_avx512.h"
#include "transpose16.h"

#define ROWS 32     /* rows of one work item: two tiles of 16 */
#define KB 128      /* keys per block */
#define MAX_D 256   /* head_dim limit (the output rows live in scratch) */
#define NEG (-1e30f) /* finite: -ffast-math assumes no infinities */
#define MAX_SLACK 8.0f

int kvf_paged_prefill_amx_rows(void) { return ROWS; }

int64_t kvf_paged_prefill_amx_layout_elems(int64_t seq, int64_t d, int64_t num_kv_heads) {
    return 2 * ((seq + KB - 1) / KB * KB) * d * num_kv_heads;
}

#if KVF_HAVE_AMX
int kvf_paged_prefill_amx_ready(void) { return amx_permitted() ? 0 : -1; }

/* 2^y to about 1e-4 relative (the probabilities are rounded to bf16, 4e-3). */
TAMX __m512 vexp2(__m512 y) { return exp2_avx512(y, EXP2_DEGREE3, 4); }

#define LOG2E 1.44269504088896341f

/* Per-thread scratch. */
typedef struct {
    uint16_t q[ROWS * MAX_D];  /* the item's rows, left operand of Q.K^T */
    float s[ROWS * KB];        /* scores of one key block, rows x keys */
    uint16_t p[ROWS * KB];     /* probabilities, rows x keys (bf16) */
    float o[ROWS * MAX_D];     /* unnormalised output, rows x head_dim */
    float m[ROWS], l[ROWS];    /* running max and sum */
    int32_t lim[ROWS];         /* last key position each row may see */
} scratch_t;

/* Scores of key tiles [kt0, kt0 + nt) (16 keys each; nt even) for the item's two row tiles,
 * into w->s. */
TAMX void scores(scratch_t *w, const uint16_t *kt, int64_t d, int64_t kt0, int64_t nt) {
    const int64_t tile_elems = 16 * d; /* one key tile of kt: d / 2 pairs x 16 keys x 2 */
    float *s = w->s;
    for (int64_t t = 0; t < nt; t += 2) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t c = 0; c < d; c += 32) {
            _tile_loadd(4, w->q + c, d * 2);
            _tile_loadd(5, w->q + 16 * d + c, d * 2);
            _tile_loadd(6, kt + (kt0 + t) * tile_elems + c * 16, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 5, 6);
            _tile_loadd(7, kt + (kt0 + t + 1) * tile_elems + c * 16, 64);
            _tile_dpbf16ps(2, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, s + t * 16, KB * 4);
        _tile_stored(1, s + 16 * KB + t * 16, KB * 4);
        _tile_stored(2, s + (t + 1) * 16, KB * 4);
        _tile_stored(3, s + 16 * KB + (t + 1) * 16, KB * 4);
    }
}

/* o[rows x d] += p[rows x n] . v[n x d] for n keys from key t0 (n and d multiples of 32). */
TAMX void values(scratch_t *w, const uint16_t *vv, int64_t d, int64_t t0, int64_t n) {
    for (int64_t e = 0; e < d; e += 32) {
        _tile_loadd(0, w->o + e, d * 4);
        _tile_loadd(1, w->o + 16 * d + e, d * 4);
        _tile_loadd(2, w->o + e + 16, d * 4);
        _tile_loadd(3, w->o + 16 * d + e + 16, d * 4);
        for (int64_t j = 0; j < n; j += 32) {
            _tile_loadd(4, w->p + j, KB * 2);
            _tile_loadd(5, w->p + 16 * KB + j, KB * 2);
            const uint16_t *vb = vv + (t0 + j) * d; /* key pair (t0 + j) / 2 onwards */
            _tile_loadd(6, vb + e * 2, d * 4);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 5, 6);
            _tile_loadd(7, vb + (e + 16) * 2, d * 4);
            _tile_dpbf16ps(2, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, w->o + e, d * 4);
        _tile_stored(1, w->o + 16 * d + e, d * 4);
        _tile_stored(2, w->o + e + 16, d * 4);
        _tile_stored(3, w->o + 16 * d + e + 16, d * 4);
    }
}

/* Row r's scores of keys t0 .. t0 + n - 1 (n a multiple of 32) -> probabilities; running max
 * (of the scaled scores) and sum updated, the row's output rescaled. Keys past lim or before
 * its window get probability 0. */
TAMX void softmax_row(scratch_t *w, int r, int64_t d, int64_t t0, int64_t n, float scale,
                      int64_t window, int edge) {
    const float *s = w->s + r * KB;
    uint16_t *p = w->p + r * KB;
    const int64_t lim = w->lim[r];
    __mmask16 keep[KB / 16], any = 0;
    __m512 mx = _mm512_set1_ps(NEG);
    for (int64_t j = 0; j < n; j += 16) {
        __mmask16 k = 0xffff;
        if (edge) {
            const __m512i t = _mm512_add_epi32(
                _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                _mm512_set1_epi32((int32_t)(t0 + j)));
            k = _mm512_cmp_epi32_mask(t, _mm512_set1_epi32((int32_t)lim), _MM_CMPINT_LE);
            if (window > 0)
                k &= _mm512_cmp_epi32_mask(t, _mm512_set1_epi32((int32_t)(lim - window)),
                                           _MM_CMPINT_GT);
        }
        keep[j / 16] = k;
        any |= k;
        mx = _mm512_mask_max_ps(mx, k, mx, _mm512_loadu_ps(s + j));
    }
    if (!any) { /* no key of this block is visible to the row */
        memset(p, 0, n * sizeof(uint16_t));
        return;
    }
    /* scale > 0: the max of the scaled scores is the scaled max. */
    const float m_old = w->m[r], m_blk = _mm512_reduce_max_ps(mx) * scale;
    /* The running max moves only when a score passes it by more than MAX_SLACK: below that,
     * probabilities up to e^MAX_SLACK are exact enough in fp32 and bf16 alike, and the row's
     * output (on tiles, in memory) is not rescaled. */
    const float m_new = m_blk > m_old + MAX_SLACK ? m_blk : m_old;
    /* p = e^(s * scale - m) = 2^(s * scale * log2(e) - m * log2(e)) */
    const __m512 sv = _mm512_set1_ps(scale * LOG2E), mv = _mm512_set1_ps(-m_new * LOG2E);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 32) {
        __m512 a = vexp2(_mm512_fmadd_ps(_mm512_loadu_ps(s + j), sv, mv));
        __m512 b = vexp2(_mm512_fmadd_ps(_mm512_loadu_ps(s + j + 16), sv, mv));
        if (edge) {
            a = _mm512_maskz_mov_ps(keep[j / 16], a);
            b = _mm512_maskz_mov_ps(keep[j / 16 + 1], b);
        }
        sum = _mm512_add_ps(sum, _mm512_add_ps(a, b));
        _mm512_storeu_si512((void *)(p + j), (__m512i)_mm512_cvtne2ps_pbh(b, a));
    }
    float alpha = 1.0f;
    if (m_new > m_old) {
        const __m512 al = vexp2(_mm512_set1_ps((m_old - m_new) * LOG2E));
        alpha = _mm512_cvtss_f32(al);
        float *o = w->o + r * d;
        for (int64_t e = 0; e < d; e += 16)
            _mm512_storeu_ps(o + e, _mm512_mul_ps(_mm512_loadu_ps(o + e), al));
    }
    w->l[r] = w->l[r] * alpha + _mm512_reduce_add_ps(sum);
    w->m[r] = m_new;
}

/* Keys and values of kv head h, tokens [t_lo, t_hi) (t_lo a multiple of 32), into the pair
 * layouts; tokens in [t_lo, seq_pad) outside [t_first, seq) are zeros. Sixteen keys at a time:
 * their dim pairs become key-tile columns through register transposes. */
TAMX void lay_out(const uint16_t *cache, const uint16_t *vals, int64_t block_size,
                  int64_t block_elems, int64_t tok_stride, int64_t head_stride,
                  const int64_t *table, int64_t h, int64_t d, int64_t t_first, int64_t seq,
                  int64_t t_lo, int64_t t_hi, uint16_t *kt, uint16_t *vv) {
    const __m512i zero = _mm512_setzero_si512();
    for (int64_t t16 = t_lo; t16 < t_hi; t16 += 16) {
        const uint16_t *kr[16], *vr[16];
        for (int i = 0; i < 16; i++) {
            const int64_t u = t16 + i;
            if (u >= t_first && u < seq) {
                /* Token u's head h: u / block_size's block, row u % block_size. */
                const int64_t off = table[u / block_size] * block_elems +
                                    (u % block_size) * tok_stride + h * head_stride;
                kr[i] = cache + off;
                vr[i] = vals + off;
            } else {
                kr[i] = vr[i] = 0;
            }
        }
        /* kt: key t's dim pair i at [t / 16][i][t % 16] (32 bits). */
        uint16_t *kd = kt + (t16 / 16) * 16 * d;
        for (int64_t e = 0; e < d; e += 32) {
            __m512i r[16];
            for (int i = 0; i < 16; i++)
                r[i] = kr[i] ? _mm512_loadu_si512((const void *)(kr[i] + e)) : zero;
            transpose16(r);
            for (int i = 0; i < 16; i++)
                _mm512_storeu_si512((void *)(kd + (e / 2 + i) * 32), r[i]);
        }
        /* vv: pair (t, t + 1) interleaved per dim. */
        for (int i = 0; i < 16; i += 2) {
            uint16_t *vd = vv + (t16 + i) * d;
            for (int64_t e = 0; e < d; e += 32) {
                const __m512i a = vr[i] ? _mm512_loadu_si512((const void *)(vr[i] + e)) : zero;
                const __m512i b =
                    vr[i + 1] ? _mm512_loadu_si512((const void *)(vr[i + 1] + e)) : zero;
                /* unpack works within 128-bit lanes: interleave, then put the lanes in order. */
                const __m512i lo = _mm512_unpacklo_epi16(a, b), hi = _mm512_unpackhi_epi16(a, b);
                const __m512i i0 = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0);
                const __m512i i1 = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
                _mm512_storeu_si512((void *)(vd + 2 * e), _mm512_permutex2var_epi64(lo, i0, hi));
                _mm512_storeu_si512((void *)(vd + 2 * e + 32),
                                    _mm512_permutex2var_epi64(lo, i1, hi));
            }
        }
    }
}

__attribute__((TAMX_ATTR)) int
kvf_paged_prefill_amx_bf16(const uint16_t *q, int64_t q_row_stride, const uint16_t *cache,
                           int64_t num_blocks, int64_t block_size, int64_t num_kv_heads,
                           int64_t d, int64_t tok_stride, int64_t head_stride,
                           const int64_t *table, int64_t ctx, int64_t q_len, int64_t group,
                           float scale, int64_t window, uint16_t *layout, uint16_t *out,
                           int num_threads) {
    if (group > ROWS || d % 32 || d > MAX_D || !amx_permitted()) return -2;
    const int64_t block_elems = block_size * num_kv_heads * d;
    const uint16_t *vals = cache + num_blocks * block_elems;
    const int64_t seq = ctx + q_len, seq_pad = (seq + KB - 1) / KB * KB;
    /* Keys no query can see (before the first query's window) are never laid out. */
    const int64_t t_first = window > 0 && ctx >= window ? ctx - window + 1 : 0;
    const int64_t t_lo = t_first / 32 * 32;
    const int64_t per_head = seq_pad * d; /* elements of kt (and of vv) per kv head */
    uint16_t *kt = layout, *vv = kt + per_head * num_kv_heads;
    const int64_t qn = ROWS / group; /* queries per item */
    const int64_t tiles = (q_len + qn - 1) / qn, items = tiles * num_kv_heads;
    const int64_t heads = num_kv_heads * group;
    const int64_t chunks = (seq_pad - t_lo + KB - 1) / KB; /* layout work per head */
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
#pragma omp for schedule(static)
        for (int64_t it = 0; it < num_kv_heads * chunks; it++) {
            const int64_t h = it / chunks, c0 = t_lo + (it % chunks) * KB;
            const int64_t c1 = c0 + KB < seq_pad ? c0 + KB : seq_pad;
            lay_out(cache, vals, block_size, block_elems, tok_stride, head_stride, table, h, d,
                    t_first, seq, c0, c1, kt + h * per_head, vv + h * per_head);
        }
        scratch_t *w = aligned_alloc(64, sizeof(scratch_t));
        if (w == NULL) failed = 1;
        else amx_configure();
        /* Head by head, so that a head's keys and values stay in the core's cache; within a
         * head later query tiles see more keys: hand them out first. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            if (w == NULL) continue;
            const int64_t tile = tiles - 1 - it % tiles, h = it / tiles;
            const int64_t q0 = tile * qn, nq = q_len - q0 < qn ? q_len - q0 : qn;
            const int64_t rows = nq * group;
            for (int64_t r = 0; r < ROWS; r++) {
                uint16_t *dst = w->q + r * d;
                if (r < rows) {
                    memcpy(dst, q + (q0 + r / group) * q_row_stride + (h * group + r % group) * d,
                           d * 2);
                } else {
                    memset(dst, 0, d * 2);
                }
                w->m[r] = NEG;
                w->l[r] = 0.0f;
                w->lim[r] = (int32_t)(ctx + q0 + (r < rows ? r / group : nq - 1));
            }
            memset(w->o, 0, sizeof(float) * ROWS * d);
            const int64_t lim0 = ctx + q0, kend = ctx + q0 + nq;
            const int64_t kstart = window > 0 && lim0 >= window ? (lim0 - window + 1) / 32 * 32 : 0;
            const int64_t lo_edge = window > 0 ? kend - window : -1;
            const uint16_t *kth = kt + h * per_head, *vvh = vv + h * per_head;
            for (int64_t t0 = kstart; t0 < kend; t0 += KB) {
                const int64_t n = (kend - t0 < KB ? (kend - t0 + 31) / 32 * 32 : KB);
                const int edge = t0 + n - 1 > lim0 || t0 <= lo_edge;
                scores(w, kth, d, t0 / 16, n / 16);
                for (int r = 0; r < ROWS; r++) softmax_row(w, r, d, t0, n, scale, window, edge);
                values(w, vvh, d, t0, n);
            }
            for (int64_t r = 0; r < rows; r++) {
                uint16_t *dst = out + ((q0 + r / group) * heads + h * group + r % group) * d;
                const __m512 inv = _mm512_set1_ps(1.0f / w->l[r]);
                for (int64_t e = 0; e < d; e += 16)
                    _mm256_storeu_si256((__m256i *)(dst + e),
                                        (__m256i)_mm512_cvtneps_pbh(
                                            _mm512_mul_ps(_mm512_loadu_ps(w->o + r * d + e), inv)));
            }
        }
        if (w != NULL) _tile_release();
        free(w);
    }
    return failed ? -1 : 0;
}
#else
int kvf_paged_prefill_amx_ready(void) { return -1; }
int kvf_paged_prefill_amx_bf16(const uint16_t *q, int64_t q_row_stride, const uint16_t *cache,
                               int64_t num_blocks, int64_t block_size, int64_t num_kv_heads,
                               int64_t d, int64_t tok_stride, int64_t head_stride,
                               const int64_t *table, int64_t ctx, int64_t q_len, int64_t group,
                               float scale, int64_t window, uint16_t *layout, uint16_t *out,
                               int num_threads) {
    return -2;
}
#endif
