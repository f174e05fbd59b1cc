/*
 * out = x @ w.T (+ bias) for bf16 x, w, bias and out, accumulated in fp32: the linear layers
 * of a bf16 model at decode sizes (a few rows), on CPU engines.
 *
 * A step of a few rows is bound by the bytes of the weight it reads. Widening the weight to
 * fp32 first writes and re-reads twice those bytes, and torch's own bf16 product is slow
 * wherever the CPU has no bf16 instructions; here each weight element is read once, as
 * bf16, and widened in registers (a bf16 is the top half of an fp32). AVX-512: a shift
 * widens the even-indexed elements of a vector, a mask the odd ones, and x, widened once per
 * call, is stored in the same even/odd order so the products pair up. AVX2: 8 weights are
 * zero-extended and shifted, in order, and x is widened in order; steps of 1-3 rows stream
 * each weight row once with a software prefetch ahead, more rows use register tiles.
 * AVX512-BF16 (CPUs with bf16 dot-product instructions): x stays bf16 and each instruction
 * sums 16 pairs of exact products into fp32 lanes, so nothing is widened at all; steps of
 * 1-4 rows stream each weight row once, more rows use 4 x 4 register tiles. AMX (CPUs with
 * bf16 tiles): the weight, in place, is the left operand of the tile products, x (laid out
 * once per call) the right one, so each weight byte is read once for up to 64 rows.
 *
 * Layouts: x [M, K] and out [M, N] with row strides in elements, w [N, K] with a row stride;
 * the K elements of a row are contiguous. Products are exact in fp32; sums run in fp32 and
 * the result is rounded to bf16 to nearest even, as torch rounds.
 *
 * Variants: AMX, AVX512-BF16, AVX-512F and AVX2+FMA (x86-64, compiled through target
 * attributes whatever -march says, so one build serves both kinds of CPU and a caller may
 * pick the smaller one), and portable C. kvf_bf16_linear_variants() says which are in this build; the caller must
 * only ask for one the CPU runs. A target attribute adds to -march=native, so on an AVX-512
 * CPU the AVX2 variant may still use AVX-512VL encodings; on an AVX2-only CPU it is pure
 * AVX2. Work is split over OpenMP threads by blocks of outputs.
 */
#define _DEFAULT_SOURCE /* syscall(), for the AMX variant's request for the tile state */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "bf16.h"
#include "rows_linear.h"
#include "variants.h"

/* Weight rows per tile (their K elements stay in L1 while every x row passes over them) and
 * x rows per tile, per variant: as many accumulators as the vector registers hold. */
#define NT 4
#define MT512 4
/* Weight rows per panel, a multiple of both tile widths: a panel (PANEL x K bf16) stays in
 * L2 while every tile of x rows, in L1, passes over it, so the weights come from memory once
 * whatever the number of rows. */
#define PANEL 48
#define NT256 3
#define MT256 4

static inline void store_out(uint16_t *out, int64_t so, const uint16_t *bias, int64_t m,
                             int64_t n, float acc) {
    if (bias) acc += bf16_to_f32(bias[n]);
    out[m * so + n] = f32_to_bf16(acc);
}

/* ---- portable ------------------------------------------------------------------------ */

static void rows_scalar(const uint16_t *x, int64_t sx, const uint16_t *w, int64_t sw,
                        const uint16_t *bias, int64_t M, int64_t n0, int64_t n1, int64_t K,
                        uint16_t *out, int64_t so) {
    for (int64_t n = n0; n < n1; n++) {
        const uint16_t *wr = w + n * sw;
        for (int64_t m = 0; m < M; m++) {
            const uint16_t *xr = x + m * sx;
            float acc = 0.0f;
            for (int64_t k = 0; k < K; k++) acc += bf16_to_f32(xr[k]) * bf16_to_f32(wr[k]);
            store_out(out, so, bias, m, n, acc);
        }
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

/* ---- AVX-512F: 16 lanes, tiles of up to 4 x rows by NT weight rows -------------------- */

#define T512 __attribute__((target("avx512f"), always_inline)) static inline

/* 32 bf16 weights as two fp32 vectors: the even-indexed ones (shifted into the top half)
 * and the odd-indexed ones (already there, the even ones masked off). */
T512 __m512 even512(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(p), 16));
}
T512 __m512 odd512(const uint16_t *p) {
    return _mm512_castsi512_ps(
        _mm512_and_si512(_mm512_loadu_si512(p), _mm512_set1_epi32((int)0xffff0000u)));
}

/* One tile of MT x rows (fp32, widened once per call) by NR weight rows; MT, NR are
 * constants after inlining. */
T512 void tile512(const float *x, int64_t sx, const uint16_t *w, int64_t sw,
                  const uint16_t *bias, int64_t m0, int MT, int64_t n0, int NR, int64_t K,
                  uint16_t *out, int64_t so) {
    __m512 acc[MT512][NT];
    for (int i = 0; i < MT; i++)
        for (int j = 0; j < NR; j++) acc[i][j] = _mm512_setzero_ps();
    const int64_t kv = K & ~(int64_t)(2 * 16 - 1);
    for (int64_t k = 0; k < kv; k += 32) {
        __m512 we[NT], wo[NT];
        for (int j = 0; j < NR; j++) {
            we[j] = even512(w + (n0 + j) * sw + k);
            wo[j] = odd512(w + (n0 + j) * sw + k);
        }
        for (int i = 0; i < MT; i++) {
            __m512 xe = _mm512_loadu_ps(x + (m0 + i) * sx + k);
            __m512 xo = _mm512_loadu_ps(x + (m0 + i) * sx + k + 16);
            for (int j = 0; j < NR; j++) {
                acc[i][j] = _mm512_fmadd_ps(xe, we[j], acc[i][j]);
                acc[i][j] = _mm512_fmadd_ps(xo, wo[j], acc[i][j]);
            }
        }
    }
    for (int i = 0; i < MT; i++) {
        for (int j = 0; j < NR; j++) {
            float s = _mm512_reduce_add_ps(acc[i][j]);
            const float *xr = x + (m0 + i) * sx;
            const uint16_t *wr = w + (n0 + j) * sw;
            for (int64_t k = kv; k < K; k++) s += xr[k] * bf16_to_f32(wr[k]);
            store_out(out, so, bias, m0 + i, n0 + j, s);
        }
    }
}

/* All weight tiles of the panel [p0, p1) against the x rows [m, m + MT_). */
#define TILE512_COLS(MT_)                                                                    \
    do {                                                                                     \
        int64_t n = p0;                                                                      \
        for (; n + NT <= p1; n += NT) tile512(x, sx, w, sw, bias, m, MT_, n, NT, K, out, so); \
        for (; n < p1; n++) tile512(x, sx, w, sw, bias, m, MT_, n, 1, K, out, so);           \
    } while (0)

__attribute__((target("avx512f"))) static void
rows_avx512(const float *x, int64_t sx, const uint16_t *w, int64_t sw, const uint16_t *bias,
            int64_t M, int64_t n0, int64_t n1, int64_t K, uint16_t *out, int64_t so) {
    FOR_PANEL_TILES(PANEL, MT512, TILE512_COLS);
}

/* ---- AVX2 + FMA: 8 lanes, tiles of up to 4 x rows by 3 weight rows (16 registers) ------- */

#define T256 __attribute__((target("avx2,fma"), always_inline)) static inline

/* Weights are widened 8 at a time, in order (widen256). Faster than the even/odd split at
 * AVX2's width, which loads each weight vector twice to fit the registers (AVX2-only Zen 2,
 * paired: 1.20x / 1.31x / 1.40x at 8 / 16 / 64 rows of `mid`'s layers, 1.05x / 1.08x / 1.38x
 * of the 0.6B shape's, 0.92x at 4 rows there). */

/* One tile of MT x rows by NR weight rows (constants after inlining). `next`: weight rows to
 * prefetch a cache line of per row and 64 bytes of this tile's, or NULL. */
T256 void tile256(const float *x, int64_t sx, const uint16_t *w, int64_t sw,
                  const uint16_t *bias, int64_t m0, int MT, int64_t n0, int NR, int64_t K,
                  uint16_t *out, int64_t so, const uint16_t *next) {
    __m256 acc[MT256][NT256];
    for (int i = 0; i < MT; i++)
        for (int j = 0; j < NR; j++) acc[i][j] = _mm256_setzero_ps();
    const int64_t kv = K & ~(int64_t)7;
    for (int64_t k = 0; k < kv; k += 8) {
        __m256 wv[NT256];
        for (int j = 0; j < NR; j++) wv[j] = widen256(w + (n0 + j) * sw + k);
        if (next && (k * (int64_t)sizeof *w) % 64 == 0)
            for (int j = 0; j < NR; j++)
                _mm_prefetch((const char *)(next + j * sw + k), _MM_HINT_T0);
        for (int i = 0; i < MT; i++) {
            __m256 xv = _mm256_loadu_ps(x + (m0 + i) * sx + k);
            for (int j = 0; j < NR; j++) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < MT; i++) {
        for (int j = 0; j < NR; j++) {
            float s = hsum256(acc[i][j]);
            const float *xr = x + (m0 + i) * sx;
            const uint16_t *wr = w + (n0 + j) * sw;
            for (int64_t k = kv; k < K; k++) s += xr[k] * bf16_to_f32(wr[k]);
            store_out(out, so, bias, m0 + i, n0 + j, s);
        }
    }
}

/* Steps of at most this many x rows stream each weight row once, front to back, and compute
 * every x row's product with it; more rows take the 4 x 3 tiles, which keep x in registers. */
#define STREAM_MAX_ROWS 3
/* How far ahead of its reads a streaming pass prefetches its weight row (and, past its end,
 * the next rows). Without it one thread streams bf16 weights at 12-13 GB/s against 15 for a
 * plain read; with it 15 GB/s, and 2 threads 28-30 GB/s against 22-25 (AVX2-only Zen 2,
 * 0.6B shape; 512 and 2048 bytes ahead were slower, docs/benchmarks.md). */
#define STREAM_PREFETCH_BYTES 1024

/* The products of MR x rows (a constant after inlining) with the weight rows [n0, n1). */
T256 void stream256(const float *x, int64_t sx, const uint16_t *w, int64_t sw,
                    const uint16_t *bias, int MR, int64_t n0, int64_t n1, int64_t K,
                    uint16_t *out, int64_t so) {
    const int64_t kv = K & ~(int64_t)31;
    for (int64_t n = n0; n < n1; n++) {
        const uint16_t *wr = w + n * sw;
        __m256 acc[STREAM_MAX_ROWS][2];
        for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
        for (int64_t k = 0; k < kv; k += 32) { /* 32 bf16: one cache line */
            _mm_prefetch((const char *)(wr + k) + STREAM_PREFETCH_BYTES, _MM_HINT_T0);
            for (int h = 0; h < 32; h += 16) {
                __m256 w0 = widen256(wr + k + h), w1 = widen256(wr + k + h + 8);
                for (int i = 0; i < MR; i++) {
                    const float *xr = x + i * sx + k + h;
                    acc[i][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xr), w0, acc[i][0]);
                    acc[i][1] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8), w1, acc[i][1]);
                }
            }
        }
        for (int i = 0; i < MR; i++) {
            float s = hsum256(_mm256_add_ps(acc[i][0], acc[i][1]));
            for (int64_t k = kv; k < K; k++) s += x[i * sx + k] * bf16_to_f32(wr[k]);
            store_out(out, so, bias, i, n, s);
        }
    }
}

#define TILE256_COLS(MT_)                                                                    \
    do {                                                                                     \
        int64_t n = p0;                                                                      \
        for (; n + NT256 <= p1; n += NT256)                                                  \
            tile256(x, sx, w, sw, bias, m, MT_, n, NT256, K, out, so, NEXT_TILE(n, NT256));  \
        for (; n < p1; n++) tile256(x, sx, w, sw, bias, m, MT_, n, 1, K, out, so, 0);        \
    } while (0)

__attribute__((target("avx2,fma"))) static void
rows_avx2(const float *x, int64_t sx, const uint16_t *w, int64_t sw, const uint16_t *bias,
          int64_t M, int64_t n0, int64_t n1, int64_t K, uint16_t *out, int64_t so) {
    switch (M) {
    case 1: stream256(x, sx, w, sw, bias, 1, n0, n1, K, out, so); return;
    case 2: stream256(x, sx, w, sw, bias, 2, n0, n1, K, out, so); return;
    case 3: stream256(x, sx, w, sw, bias, 3, n0, n1, K, out, so); return;
    }
    FOR_PANEL_TILES(PANEL, MT256, TILE256_COLS);
}

/* ---- AVX512-BF16: x and w as they are, 32 bf16 (16 pairs) per dot-product instruction -- */

#define TBF __attribute__((target("avx512f,avx512bw,avx512bf16"), always_inline)) static inline

/* The n (at most 32) bf16 at p as one vector, zeros past them: a zero pair adds nothing, and
 * the masked load never touches memory past p + n. */
TBF __m512bh load_bh(const uint16_t *p, int64_t n) {
    if (n >= 32) return (__m512bh)_mm512_loadu_si512(p);
    return (__m512bh)_mm512_maskz_loadu_epi16((__mmask32)((1u << n) - 1u), p);
}

/* Steps of at most this many x rows stream each weight row once (two accumulators per row,
 * so consecutive dot products do not wait on each other); more rows take 4 x 4 tiles. */
#define BF_STREAM_MAX_ROWS 4
#define BF_MT 4
#define BF_NT 4

/* The products of MR x rows (a constant after inlining) with the weight rows [n0, n1). */
TBF void streambf(const uint16_t *x, int64_t sx, const uint16_t *w, int64_t sw,
                  const uint16_t *bias, int MR, int64_t n0, int64_t n1, int64_t K,
                  uint16_t *out, int64_t so) {
    for (int64_t n = n0; n < n1; n++) {
        const uint16_t *wr = w + n * sw;
        __m512 acc[BF_STREAM_MAX_ROWS][2];
        for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
        int64_t k = 0;
        for (; k + 64 <= K; k += 64) { /* two cache lines of the weight row */
            _mm_prefetch((const char *)(wr + k) + STREAM_PREFETCH_BYTES, _MM_HINT_T0);
            _mm_prefetch((const char *)(wr + k) + STREAM_PREFETCH_BYTES + 64, _MM_HINT_T0);
            const __m512bh w0 = load_bh(wr + k, 32), w1 = load_bh(wr + k + 32, 32);
            for (int i = 0; i < MR; i++) {
                acc[i][0] = _mm512_dpbf16_ps(acc[i][0], w0, load_bh(x + i * sx + k, 32));
                acc[i][1] = _mm512_dpbf16_ps(acc[i][1], w1, load_bh(x + i * sx + k + 32, 32));
            }
        }
        for (; k < K; k += 32) {
            const __m512bh wv = load_bh(wr + k, K - k);
            for (int i = 0; i < MR; i++)
                acc[i][0] = _mm512_dpbf16_ps(acc[i][0], wv, load_bh(x + i * sx + k, K - k));
        }
        for (int i = 0; i < MR; i++) {
            const float sum = _mm512_reduce_add_ps(_mm512_add_ps(acc[i][0], acc[i][1]));
            store_out(out, so, bias, i, n, sum);
        }
    }
}

/* One tile of MT x rows by NR weight rows (constants after inlining); `next` as in tile256. */
TBF void tilebf(const uint16_t *x, int64_t sx, const uint16_t *w, int64_t sw,
                const uint16_t *bias, int64_t m0, int MT, int64_t n0, int NR, int64_t K,
                uint16_t *out, int64_t so, const uint16_t *next) {
    __m512 acc[BF_MT][BF_NT];
    for (int i = 0; i < MT; i++)
        for (int j = 0; j < NR; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        const int64_t len = K - k;
        __m512bh wv[BF_NT];
        for (int j = 0; j < NR; j++) wv[j] = load_bh(w + (n0 + j) * sw + k, len);
        if (next)
            for (int j = 0; j < NR; j++)
                _mm_prefetch((const char *)(next + j * sw + k), _MM_HINT_T0);
        for (int i = 0; i < MT; i++) {
            const __m512bh xv = load_bh(x + (m0 + i) * sx + k, len);
            for (int j = 0; j < NR; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv[j], xv);
        }
    }
    for (int i = 0; i < MT; i++)
        for (int j = 0; j < NR; j++)
            store_out(out, so, bias, m0 + i, n0 + j, _mm512_reduce_add_ps(acc[i][j]));
}

#define TILEBF_COLS(MT_)                                                                     \
    do {                                                                                     \
        int64_t n = p0;                                                                      \
        for (; n + BF_NT <= p1; n += BF_NT)                                                  \
            tilebf(x, sx, w, sw, bias, m, MT_, n, BF_NT, K, out, so, NEXT_TILE(n, BF_NT));   \
        for (; n < p1; n++) tilebf(x, sx, w, sw, bias, m, MT_, n, 1, K, out, so, 0);         \
    } while (0)

__attribute__((target("avx512f,avx512bw,avx512bf16"))) static void
rows_avx512bf16(const uint16_t *x, int64_t sx, const uint16_t *w, int64_t sw,
                const uint16_t *bias, int64_t M, int64_t n0, int64_t n1, int64_t K,
                uint16_t *out, int64_t so) {
    switch (M) {
    case 1: streambf(x, sx, w, sw, bias, 1, n0, n1, K, out, so); return;
    case 2: streambf(x, sx, w, sw, bias, 2, n0, n1, K, out, so); return;
    case 3: streambf(x, sx, w, sw, bias, 3, n0, n1, K, out, so); return;
    case 4: streambf(x, sx, w, sw, bias, 4, n0, n1, K, out, so); return;
    }
    FOR_PANEL_TILES(PANEL, BF_MT, TILEBF_COLS);
}

/* ---- AMX: tiles of 16 weight rows x 32 inputs against 16 x rows ----------------------- *
 * The weight is the left operand, read in place: a tile is 16 weight rows' next 64 bytes.
 * x is the right one, laid out once per call in the tiles' pair order (for each pair of
 * inputs, the pair of every row of a block of 16 rows, zeros for rows past M). Each tile of
 * products is then 16 outputs for each of 16 x rows, transposed into out by the epilogue. */
#if KVF_HAVE_AMX
/* x blocks (16 rows each) one weight tile meets: as many accumulators as tiles are left
 * after the weight tile and the x tiles (8 in all). */
#define AMX_MB 4

/* One block of products (16 outputs from n x 16 rows from m0, fp32, output-major) into out
 * for the mc rows that exist, with the inputs past kv (not a multiple of 32) and the bias. */
TAMX void amx_emit(const float *c, const uint16_t *x, int64_t sx, const uint16_t *w, int64_t sw,
                   const uint16_t *bias, int64_t m0, int64_t mc, int64_t n, int64_t K,
                   int64_t kv, uint16_t *out, int64_t so) {
    const __m512i column = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
        _mm512_set1_epi32(16));
    __m512 b = _mm512_setzero_ps();
    if (bias)
        b = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(bias + n))), 16));
    for (int64_t i = 0; i < mc; i++) {
        __m512 v = _mm512_add_ps(_mm512_i32gather_ps(column, c + i, 4), b);
        if (kv < K) {
            float t[16];
            _mm512_storeu_ps(t, v);
            const uint16_t *xr = x + (m0 + i) * sx;
            for (int r = 0; r < 16; r++)
                for (int64_t k = kv; k < K; k++)
                    t[r] += bf16_to_f32(xr[k]) * bf16_to_f32(w[(n + r) * sw + k]);
            v = _mm512_loadu_ps(t);
        }
        _mm256_storeu_si256((__m256i *)(out + (m0 + i) * so + n), (__m256i)_mm512_cvtneps_pbh(v));
    }
}

/* The 16 outputs from n for the x blocks [mb0, mb0 + MB) (MB a constant after inlining):
 * one weight tile per 32 inputs, read from memory once, meets every block's x tile. `next`:
 * the next block's 16 weight rows, or NULL; with more than one x block, each step prefetches
 * the next block's 64 bytes at the same inputs, which overlaps its reads with this block's
 * products (with one x block there is too little work per tile to hide them). */
TAMX void amx_block(const uint32_t *xp, int64_t xstride, const uint16_t *x, int64_t sx,
                    const uint16_t *w, int64_t sw, const uint16_t *bias, int64_t M, int64_t mb0,
                    const int MB, int64_t n, int64_t K, int64_t kv, uint16_t *out, int64_t so,
                    const uint16_t *next) {
    float c[AMX_MB][256] __attribute__((aligned(64)));
    const uint16_t *wr = w + n * sw;
    const int64_t wstride = sw * (int64_t)sizeof *w;
    const uint32_t *xb = xp + mb0 * xstride;
    _tile_zero(0);
    if (MB > 1) _tile_zero(1);
    if (MB > 2) _tile_zero(2);
    if (MB > 3) _tile_zero(3);
    for (int64_t k = 0; k < kv; k += 32) {
        if (MB > 1 && next)
            for (int r = 0; r < 16; r++)
                _mm_prefetch((const char *)(next + r * sw + k), _MM_HINT_T0);
        _tile_loadd(4, wr + k, wstride);
        _tile_loadd(5, xb + k * 8, 64);
        _tile_dpbf16ps(0, 4, 5);
        if (MB > 1) {
            _tile_loadd(6, xb + xstride + k * 8, 64);
            _tile_dpbf16ps(1, 4, 6);
        }
        if (MB > 2) {
            _tile_loadd(7, xb + 2 * xstride + k * 8, 64);
            _tile_dpbf16ps(2, 4, 7);
        }
        if (MB > 3) {
            _tile_loadd(5, xb + 3 * xstride + k * 8, 64);
            _tile_dpbf16ps(3, 4, 5);
        }
    }
    _tile_stored(0, c[0], 64);
    if (MB > 1) _tile_stored(1, c[1], 64);
    if (MB > 2) _tile_stored(2, c[2], 64);
    if (MB > 3) _tile_stored(3, c[3], 64);
    for (int b = 0; b < MB; b++) {
        const int64_t m0 = (mb0 + b) * 16, mc = M - m0 < 16 ? M - m0 : 16;
        amx_emit(c[b], x, sx, w, sw, bias, m0, mc, n, K, kv, out, so);
    }
}

/* The outputs [n0, n1): whole blocks of 16 on tiles, the rows after the last one (N not a
 * multiple of 16) with the dot-product instructions. */
__attribute__((TAMX_ATTR)) static void
rows_amx(const uint32_t *xp, int64_t xstride, const uint16_t *x, int64_t sx, const uint16_t *w,
         int64_t sw, const uint16_t *bias, int64_t M, int64_t n0, int64_t n1, int64_t K,
         uint16_t *out, int64_t so) {
    const int64_t kv = K & ~(int64_t)31, blocks = (M + 15) / 16;
    amx_configure();
    int64_t n = n0;
    for (; n + 16 <= n1; n += 16)
        for (int64_t mb = 0; mb < blocks; mb += AMX_MB) {
            /* Only the first pass over a block reads it from memory. */
            const uint16_t *nx = mb == 0 && n + 32 <= n1 ? w + (n + 16) * sw : 0;
            switch (blocks - mb) {
            case 1: amx_block(xp, xstride, x, sx, w, sw, bias, M, mb, 1, n, K, kv, out, so, nx); break;
            case 2: amx_block(xp, xstride, x, sx, w, sw, bias, M, mb, 2, n, K, kv, out, so, nx); break;
            case 3: amx_block(xp, xstride, x, sx, w, sw, bias, M, mb, 3, n, K, kv, out, so, nx); break;
            default: amx_block(xp, xstride, x, sx, w, sw, bias, M, mb, 4, n, K, kv, out, so, nx);
            }
        }
    _tile_release();
    if (n < n1) rows_avx512bf16(x, sx, w, sw, bias, M, n, n1, K, out, so);
}
#endif

#define KVF_VARIANTS                                                                         \
    ((1 << KVF_SCALAR) | (1 << KVF_AVX2) | (1 << KVF_AVX512) | (1 << KVF_AVX512BF16) |       \
     (KVF_HAVE_AMX << KVF_AMX))
#else
#define KVF_VARIANTS (1 << KVF_SCALAR)
#endif

/* Bit v set: variant v (KVF_SCALAR, KVF_AVX2, KVF_AVX512, KVF_AVX512BF16, KVF_AMX) is in
 * this build. */
int kvf_bf16_linear_variants(void) { return KVF_VARIANTS; }

/* 0 when the AMX variant can run in this process (it is in the build and Linux grants the
 * tile state), -1 otherwise. */
int kvf_bf16_linear_amx_ready(void) {
#if KVF_HAVE_AMX
    return amx_permitted() ? 0 : -1;
#else
    return -1;
#endif
}

/* x widened to fp32 once per call, in a buffer the calling thread keeps: decode calls are
 * small and many, and a fresh allocation of this size would fault its pages in every time. */
static _Thread_local float *xbuf;
static _Thread_local int64_t xbuf_len;

/* With lanes > 0 each full block of 2 * lanes elements is stored evens first, then odds, the
 * order in which the AVX-512 tiles widen the weights; the tail past the last full block, and
 * every element with lanes == 0, keeps its order. */
static const float *widen_x(const uint16_t *x, int64_t sx, int64_t M, int64_t K, int64_t lanes) {
    if (xbuf_len < M * K) {
        free(xbuf);
        xbuf = malloc((size_t)(M * K) * sizeof(float));
        xbuf_len = xbuf ? M * K : 0;
        if (!xbuf) return 0;
    }
    const int64_t blk = 2 * lanes, kv = lanes ? K - K % blk : 0;
    for (int64_t m = 0; m < M; m++) {
        const uint16_t *xr = x + m * sx;
        float *d = xbuf + m * K;
        for (int64_t k = 0; k < kv; k += blk)
            for (int64_t i = 0; i < lanes; i++) {
                d[k + i] = bf16_to_f32(xr[k + 2 * i]);
                d[k + lanes + i] = bf16_to_f32(xr[k + 2 * i + 1]);
            }
        for (int64_t k = kv; k < K; k++) d[k] = bf16_to_f32(xr[k]);
    }
    return xbuf;
}

#if KVF_HAVE_AMX
/* x in the AMX variant's pair order, in a buffer the calling thread keeps (as xbuf): block b
 * of 16 rows holds, for each pair p of the first kv inputs, the pair of each of its rows
 * (zeros for rows past M) at [b * (kv / 2) * 16 + p * 16 + row]. */
static _Thread_local uint32_t *pbuf;
static _Thread_local int64_t pbuf_len;

__attribute__((TAMX_ATTR)) static const uint32_t *pair_x(const uint16_t *x, int64_t sx,
                                                         int64_t M, int64_t kv) {
    const int64_t blocks = (M + 15) / 16, stride = kv / 2 * 16;
    if (!pbuf || pbuf_len < blocks * stride) {
        free(pbuf);
        pbuf = aligned_alloc(64, (size_t)(blocks * stride) * sizeof *pbuf + 64);
        pbuf_len = pbuf ? blocks * stride : 0;
        if (!pbuf) return 0;
    }
    if (sx > (INT32_MAX >> 5)) { /* row offsets past a 32-bit gather index: pair by pair */
        for (int64_t b = 0; b < blocks; b++) {
            uint32_t *d = pbuf + b * stride;
            const int64_t rows = M - b * 16 < 16 ? M - b * 16 : 16;
            memset(d, 0, (size_t)stride * sizeof *d);
            for (int64_t i = 0; i < rows; i++)
                for (int64_t p = 0; p < kv / 2; p++)
                    memcpy(d + p * 16 + i, x + (b * 16 + i) * sx + 2 * p, 4);
        }
        return pbuf;
    }
    const __m512i rows_at = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
        _mm512_set1_epi32((int)(sx * (int64_t)sizeof *x)));
    for (int64_t b = 0; b < blocks; b++) {
        uint32_t *d = pbuf + b * stride;
        const int64_t rows = M - b * 16 < 16 ? M - b * 16 : 16;
        const __mmask16 live = (__mmask16)((1u << rows) - 1u);
        const uint16_t *xb = x + b * 16 * sx;
        for (int64_t p = 0; p < kv / 2; p++)
            _mm512_store_si512(d + p * 16, _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live,
                                                                      rows_at, xb + 2 * p, 1));
    }
    return pbuf;
}
#endif

/* Returns 0; -1 when `variant` is not in this build (or, for KVF_AMX, cannot run: see
 * kvf_bf16_linear_amx_ready), -2 when out of memory (nothing is written then). */
int kvf_bf16_linear(int variant, const uint16_t *x, int64_t sx, const uint16_t *w, int64_t sw,
                    const uint16_t *bias, int64_t M, int64_t N, int64_t K, uint16_t *out,
                    int64_t so, int num_threads) {
    if (variant < 0 || variant > KVF_AMX || !(KVF_VARIANTS & (1 << variant))) return -1;
    if (variant == KVF_AMX && kvf_bf16_linear_amx_ready() != 0) return -1;
    if (M <= 0 || N <= 0) return 0;
    const float *xf = 0;
    const int widen = variant == KVF_AVX2 || variant == KVF_AVX512;
    if (widen && !(xf = widen_x(x, sx, M, K, variant == KVF_AVX2 ? 0 : 16))) return -2;
    const uint32_t *xp = 0;
    (void)xp;
#if KVF_HAVE_AMX
    if (variant == KVF_AMX && !(xp = pair_x(x, sx, M, K & ~(int64_t)31))) return -2;
#endif
    /* outputs per tile */
    const int64_t nb = variant == KVF_AMX ? 16 : variant == KVF_AVX2 ? NT256 : NT;
    const int parallel = M * N * K >= PARALLEL_MIN_MACS && num_threads > 1;
#pragma omp parallel num_threads(num_threads) if (parallel)
    {
        int64_t n0, n1;
        thread_outputs(N, nb, &n0, &n1);
        if (n0 < n1) {
#if KVF_HAVE_AMX
            if (variant == KVF_AMX)
                rows_amx(xp, (K & ~(int64_t)31) / 2 * 16, x, sx, w, sw, bias, M, n0, n1, K, out,
                         so);
            else
#endif
#if defined(__x86_64__) && defined(__GNUC__)
            if (variant == KVF_AVX512BF16)
                rows_avx512bf16(x, sx, w, sw, bias, M, n0, n1, K, out, so);
            else if (variant == KVF_AVX512)
                rows_avx512(xf, K, w, sw, bias, M, n0, n1, K, out, so);
            else if (variant == KVF_AVX2)
                rows_avx2(xf, K, w, sw, bias, M, n0, n1, K, out, so);
            else
#endif
                rows_scalar(x, sx, w, sw, bias, M, n0, n1, K, out, so);
        }
    }
    return 0;
}
