/*
 * out = x @ w.T (+ bias) in fp32 for steps of a few rows (decode), on CPU engines.
 *
 * A step of a few rows reads every weight once and does little arithmetic per byte. On the
 * AVX2-only AMD CPUs measured, oneDNN's blocked GEMM reaches neither the memory rate nor the
 * arithmetic rate there (docs/benchmarks.md); this kernel streams each weight row once per
 * tile of x rows, the tile's x rows staying in L1 and a panel of weight rows in L2 while
 * every tile of x rows passes over it.
 *
 * Layouts: x [M, K] and out [M, N] with row strides in elements, w [N, K] with a row stride;
 * the K elements of a row are contiguous. Sums run in fp32 in an order of their own (eight
 * lanes, then across lanes), so results differ from torch's by rounding only.
 *
 * Variants: AVX-512F, AVX2+FMA (x86-64, compiled through target attributes whatever -march
 * says) and portable C. kvf_f32_linear_variants() says which are in this build; the caller
 * must only ask for one the CPU runs. Work is split over OpenMP threads by blocks of outputs.
 * The AVX-512 variant's tiles are 8 x rows deep (32 registers hold 24 accumulators), so a
 * step of up to 8 rows streams each weight once and computes 8 products per weight load.
 */
#include <stdint.h>

#include "rows_linear.h"
#include "variants.h"

/* Weight rows and x rows per tile: 12 accumulators, 3 weight vectors and an x vector fill
 * the 16 vector registers (4 x 3 was the fastest shape measured against 8 x 1, 6 x 2, 8 x 2
 * and 4 x 2). */
#define NT 3
#define MT 4
/* Weight rows per panel, a multiple of NT (the panel size barely mattered, 12 to 768). Steps
 * of fewer than MT rows prefetch nothing: one x row streams fp32 weights near the memory rate
 * unaided, and the prefetches cost it 7-10% (AVX2-only Zen 2). */
#define PANEL 48

static inline void store_out(float *out, int64_t so, const float *bias, int64_t m, int64_t n,
                             float acc) {
    out[m * so + n] = bias ? acc + bias[n] : acc;
}

/* ---- portable ------------------------------------------------------------------------ */

static void rows_scalar(const float *x, int64_t sx, const float *w, int64_t sw,
                        const float *bias, int64_t M, int64_t n0, int64_t n1, int64_t K,
                        float *out, int64_t so) {
    for (int64_t n = n0; n < n1; n++) {
        const float *wr = w + n * sw;
        for (int64_t m = 0; m < M; m++) {
            const float *xr = x + m * sx;
            float acc = 0.0f;
            for (int64_t k = 0; k < K; k++) acc += xr[k] * wr[k];
            store_out(out, so, bias, m, n, acc);
        }
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

/* ---- AVX2 + FMA: 8 lanes, tiles of up to MT x rows by NT weight rows ------------------- */

#define T256 __attribute__((target("avx2,fma"), always_inline)) static inline

/* One tile of MTn x rows by NR weight rows; both are constants after inlining. `next`: weight
 * rows to prefetch a cache line of per row and 64 bytes of this tile's, or NULL. */
T256 void tile256(const float *x, int64_t sx, const float *w, int64_t sw, const float *bias,
                  int64_t m0, int MTn, int64_t n0, int NR, int64_t K, float *out, int64_t so,
                  const float *next) {
    __m256 acc[MT][NT];
    for (int i = 0; i < MTn; i++)
        for (int j = 0; j < NR; j++) acc[i][j] = _mm256_setzero_ps();
    const int64_t kv = K & ~(int64_t)7;
    for (int64_t k = 0; k < kv; k += 8) {
        __m256 wv[NT];
        for (int j = 0; j < NR; j++) wv[j] = _mm256_loadu_ps(w + (n0 + j) * sw + k);
        if (next && (k * (int64_t)sizeof *w) % 64 == 0)
            for (int j = 0; j < NR; j++)
                _mm_prefetch((const char *)(next + j * sw + k), _MM_HINT_T0);
        for (int i = 0; i < MTn; i++) {
            __m256 xv = _mm256_loadu_ps(x + (m0 + i) * sx + k);
            for (int j = 0; j < NR; j++) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < MTn; i++) {
        for (int j = 0; j < NR; j++) {
            float s = hsum256(acc[i][j]);
            const float *xr = x + (m0 + i) * sx;
            const float *wr = w + (n0 + j) * sw;
            for (int64_t k = kv; k < K; k++) s += xr[k] * wr[k];
            store_out(out, so, bias, m0 + i, n0 + j, s);
        }
    }
}

/* All weight tiles of the panel [p0, p1) against the x rows [m, m + MT_). */
#define TILE256_COLS(MT_)                                                                    \
    do {                                                                                     \
        int64_t n = p0;                                                                      \
        for (; n + NT <= p1; n += NT)                                                        \
            tile256(x, sx, w, sw, bias, m, MT_, n, NT, K, out, so,                           \
                    MT_ == MT ? NEXT_TILE(n, NT) : 0);                                       \
        for (; n < p1; n++) tile256(x, sx, w, sw, bias, m, MT_, n, 1, K, out, so, 0);        \
    } while (0)

__attribute__((target("avx2,fma"))) static void
rows_avx2(const float *x, int64_t sx, const float *w, int64_t sw, const float *bias, int64_t M,
          int64_t n0, int64_t n1, int64_t K, float *out, int64_t so) {
    FOR_PANEL_TILES(PANEL, MT, TILE256_COLS);
}

/* ---- AVX-512F: 16 lanes, tiles of up to MT512 x rows by NT weight rows ----------------- */

#define MT512 8
#define T512 __attribute__((target("avx512f"), always_inline)) static inline

/* One tile of MTn x rows by NR weight rows (constants after inlining); `next` as in tile256,
 * one cache line per weight row and 16 elements. */
T512 void tile512(const float *x, int64_t sx, const float *w, int64_t sw, const float *bias,
                  int64_t m0, int MTn, int64_t n0, int NR, int64_t K, float *out, int64_t so,
                  const float *next) {
    __m512 acc[MT512][NT];
    for (int i = 0; i < MTn; i++)
        for (int j = 0; j < NR; j++) acc[i][j] = _mm512_setzero_ps();
    const int64_t kv = K & ~(int64_t)15;
    for (int64_t k = 0; k < kv; k += 16) {
        __m512 wv[NT];
        for (int j = 0; j < NR; j++) wv[j] = _mm512_loadu_ps(w + (n0 + j) * sw + k);
        if (next)
            for (int j = 0; j < NR; j++)
                _mm_prefetch((const char *)(next + j * sw + k), _MM_HINT_T0);
        for (int i = 0; i < MTn; i++) {
            __m512 xv = _mm512_loadu_ps(x + (m0 + i) * sx + k);
            for (int j = 0; j < NR; j++) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < MTn; i++) {
        for (int j = 0; j < NR; j++) {
            float s = _mm512_reduce_add_ps(acc[i][j]);
            const float *xr = x + (m0 + i) * sx;
            const float *wr = w + (n0 + j) * sw;
            for (int64_t k = kv; k < K; k++) s += xr[k] * wr[k];
            store_out(out, so, bias, m0 + i, n0 + j, s);
        }
    }
}

/* All weight tiles of the panel [p0, p1) against the x rows [m, m + MT_); every pass that
 * starts at x row 0 prefetches the next tile's weight rows (the later passes find them in
 * L2). */
#define TILE512_COLS(MT_)                                                                    \
    do {                                                                                     \
        int64_t n = p0;                                                                      \
        for (; n + NT <= p1; n += NT)                                                        \
            tile512(x, sx, w, sw, bias, m, MT_, n, NT, K, out, so, NEXT_TILE(n, NT));        \
        for (; n < p1; n++) tile512(x, sx, w, sw, bias, m, MT_, n, 1, K, out, so, 0);        \
    } while (0)

__attribute__((target("avx512f"))) static void
rows_avx512(const float *x, int64_t sx, const float *w, int64_t sw, const float *bias,
            int64_t M, int64_t n0, int64_t n1, int64_t K, float *out, int64_t so) {
    for (int64_t p0 = n0; p0 < n1; p0 += PANEL) {
        const int64_t p1 = p0 + PANEL < n1 ? p0 + PANEL : n1;
        int64_t m = 0;
        for (; m + MT512 <= M; m += MT512) TILE512_COLS(MT512);
        switch (M - m) {
        case 7: TILE512_COLS(7); break;
        case 6: TILE512_COLS(6); break;
        case 5: TILE512_COLS(5); break;
        case 4: TILE512_COLS(4); break;
        case 3: TILE512_COLS(3); break;
        case 2: TILE512_COLS(2); break;
        case 1: TILE512_COLS(1); break;
        }
    }
}

#define KVF_VARIANTS ((1 << KVF_SCALAR) | (1 << KVF_AVX2) | (1 << KVF_AVX512))
#else
#define KVF_VARIANTS (1 << KVF_SCALAR)
#endif

/* Bit v set: variant v (KVF_SCALAR, KVF_AVX2, KVF_AVX512) is in this build. */
int kvf_f32_linear_variants(void) { return KVF_VARIANTS; }

/* Returns 0; -1 when `variant` is not in this build. */
int kvf_f32_linear(int variant, const float *x, int64_t sx, const float *w, int64_t sw,
                   const float *bias, int64_t M, int64_t N, int64_t K, float *out, int64_t so,
                   int num_threads) {
    if (variant < 0 || variant > KVF_AVX512 || !(KVF_VARIANTS & (1 << variant))) return -1;
    if (M <= 0 || N <= 0) return 0;
    const int parallel = M * N * K >= PARALLEL_MIN_MACS && num_threads > 1;
#pragma omp parallel num_threads(num_threads) if (parallel)
    {
        int64_t n0, n1;
        thread_outputs(N, NT, &n0, &n1);
        if (n0 < n1) {
#if defined(__x86_64__) && defined(__GNUC__)
            if (variant == KVF_AVX512)
                rows_avx512(x, sx, w, sw, bias, M, n0, n1, K, out, so);
            else if (variant == KVF_AVX2)
                rows_avx2(x, sx, w, sw, bias, M, n0, n1, K, out, so);
            else
#endif
                rows_scalar(x, sx, w, sw, bias, M, n0, n1, K, out, so);
        }
    }
    return 0;
}
