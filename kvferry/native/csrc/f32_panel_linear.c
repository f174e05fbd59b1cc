/*
 * out = x @ w.T (+ bias) in fp32 for steps of up to ~128 rows (decode batches, the logits),
 * on AVX-512 CPUs, from a copy of the weight laid out in panels.
 *
 * A step of a few dozen rows is neither memory- nor compute-bound: reading the weights from
 * DRAM takes about as long as the arithmetic on them. oneDNN's packed GEMM and the dense-row
 * kernel (f32_linear.c) both read a stretch of the weight from memory and then compute on
 * it, one after the other, and reach half the CPU's fp32 rate at 32 rows (docs/benchmarks.md);
 * the dense-row kernel also loads 8 x vectors per 3 weight vectors, which L1 cannot feed.
 * Here every weight panel is read from L2 by outer products, and while the passes of x rows
 * compute on one panel they prefetch the next one from DRAM into L2, so the two overlap.
 *
 * Layouts:
 *   panels  [ceil(N / NP)][K][NP], made once from the weight [N, K]: panel b holds outputs
 *           b*NP .. b*NP+NP-1, for each input k their NP weights side by side; outputs
 *           past N are zero (NP: kvf_f32_panel_width())
 *   x       [M, K], out [M, N], both with row strides in elements; bias [N] or NULL
 * Each output is one fp32 sum over k in order (no lane split), so results differ from torch's
 * by rounding only.
 *
 * kvf_f32_panel_linear_available() says whether this build has the AVX-512 code (x86-64 with
 * GCC or clang; compiled through target attributes whatever -march says); the caller must
 * only use it on a CPU with AVX-512F. Work is split over OpenMP threads by whole panels
 * (rows_linear.h, shared with the dense-row kernels).
 */
#include <stdint.h>

#include "rows_linear.h"

/* Outputs per panel: three 16-lane vectors. With MR x rows per pass the micro-kernel holds
 * MR x 3 = 24 accumulators, three weight vectors and a broadcast x value in the 32 vector
 * registers; per input k it loads 3 weight vectors and MR x values for 24 fused
 * multiply-adds. */
#define NP 48
#define MR 8

/* Outputs per panel (the layout's NP). */
int kvf_f32_panel_width(void) { return NP; }

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define T512 __attribute__((target("avx512f"), always_inline)) static inline

/* x rows [0, R) against one panel (outputs n0 .., nn of them valid). `ahead`: the next
 * panel, of which this pass prefetches into L2 the rows k with k % every == phase (NULL:
 * none): the `every` passes over a panel between them fetch all of the next one. */
T512 void pass512(const float *x, int64_t sx, const float *p, int64_t K, int R, float *out,
                  int64_t so, const float *bias, int64_t n0, int64_t nn, const float *ahead,
                  int every, int phase) {
    __m512 acc[MR][3];
    for (int i = 0; i < R; i++)
        for (int j = 0; j < 3; j++) acc[i][j] = _mm512_setzero_ps();
    int until = phase;
    for (int64_t k = 0; k < K; k++) {
        const float *wk = p + k * NP;
        const __m512 w0 = _mm512_loadu_ps(wk), w1 = _mm512_loadu_ps(wk + 16),
                     w2 = _mm512_loadu_ps(wk + 32);
        if (ahead && until-- == 0) {
            until = every - 1;
            /* NP floats are three cache lines. */
            _mm_prefetch((const char *)(ahead + k * NP), _MM_HINT_T1);
            _mm_prefetch((const char *)(ahead + k * NP + 16), _MM_HINT_T1);
            _mm_prefetch((const char *)(ahead + k * NP + 32), _MM_HINT_T1);
        }
        for (int i = 0; i < R; i++) {
            const __m512 xv = _mm512_set1_ps(x[i * sx + k]);
            acc[i][0] = _mm512_fmadd_ps(xv, w0, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(xv, w1, acc[i][1]);
            acc[i][2] = _mm512_fmadd_ps(xv, w2, acc[i][2]);
        }
    }
    __m512 b[3] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    const __mmask16 lanes[3] = {
        (__mmask16)(nn >= 16 ? 0xFFFF : (1u << nn) - 1),
        (__mmask16)(nn >= 32 ? 0xFFFF : nn <= 16 ? 0 : (1u << (nn - 16)) - 1),
        (__mmask16)(nn >= 48 ? 0xFFFF : nn <= 32 ? 0 : (1u << (nn - 32)) - 1),
    };
    if (bias)
        for (int j = 0; j < 3; j++) b[j] = _mm512_maskz_loadu_ps(lanes[j], bias + n0 + 16 * j);
    for (int i = 0; i < R; i++)
        for (int j = 0; j < 3; j++)
            _mm512_mask_storeu_ps(out + i * so + n0 + 16 * j, lanes[j],
                                  _mm512_add_ps(acc[i][j], b[j]));
}

/* The panels [b0, b1) against every x row. */
__attribute__((target("avx512f"))) static void
panels512(const float *x, int64_t sx, const float *panels, const float *bias, int64_t M,
          int64_t N, int64_t K, float *out, int64_t so, int64_t b0, int64_t b1) {
    const int passes = (int)((M + MR - 1) / MR);
    for (int64_t b = b0; b < b1; b++) {
        const float *p = panels + b * K * NP;
        const float *ahead = b + 1 < b1 ? p + K * NP : 0;
        const int64_t n0 = b * NP, nn = N - n0 < NP ? N - n0 : NP;
        int pass = 0;
        for (int64_t m = 0; m < M; m += MR, pass++) {
            const float *xm = x + m * sx;
            float *om = out + m * so;
            switch (M - m < MR ? (int)(M - m) : MR) {
#define PASS(R)                                                                               \
    case R:                                                                                   \
        pass512(xm, sx, p, K, R, om, so, bias, n0, nn, ahead, passes, pass);                  \
        break;
                PASS(8) PASS(7) PASS(6) PASS(5) PASS(4) PASS(3) PASS(2) PASS(1)
#undef PASS
            }
        }
    }
}

int kvf_f32_panel_linear_available(void) { return 1; }

/* Returns 0; -1 when this build has no AVX-512 code. */
int kvf_f32_panel_linear(const float *x, int64_t sx, const float *panels, const float *bias,
                         int64_t M, int64_t N, int64_t K, float *out, int64_t so,
                         int num_threads) {
    if (M <= 0 || N <= 0) return 0;
    const int parallel = M * N * K >= PARALLEL_MIN_MACS && num_threads > 1;
#pragma omp parallel num_threads(num_threads) if (parallel)
    {
        int64_t n0, n1;
        thread_outputs(N, NP, &n0, &n1); /* whole panels per thread */
        if (n0 < n1)
            panels512(x, sx, panels, bias, M, N, K, out, so, n0 / NP, (n1 + NP - 1) / NP);
    }
    return 0;
}
#else
int kvf_f32_panel_linear_available(void) { return 0; }

int kvf_f32_panel_linear(const float *x, int64_t sx, const float *panels, const float *bias,
                         int64_t M, int64_t N, int64_t K, float *out, int64_t so,
                         int num_threads) {
    (void)x, (void)sx, (void)panels, (void)bias, (void)M, (void)N, (void)K, (void)out,
        (void)so, (void)num_threads;
    return -1;
}
#endif
