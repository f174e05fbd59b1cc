/*
 * Fused elementwise steps of a decoder layer, fp32 and bf16, for CPU engines.
 *
 * In torch each of these is 3-8 small ops (an RMSNorm is pow, mean, add, rsqrt, mul, mul),
 * each of which dispatches, allocates and makes a pass over memory; at decode sizes the
 * dispatch dominates and at prefill sizes the passes do. Here each is one pass per row.
 *
 *   add_rms_norm   residual += x (unless x is NULL); out = rms_norm(residual) * weight, each
 *                  row's `heads` groups of `dim` elements normalised on their own (heads = 1:
 *                  whole rows; more: Qwen3's per-head q/k norm)
 *   rotary         rotate-half rotary embedding of `heads` heads of each row, in place
 *   silu_mul       out = silu(gate) * up, gate and up the two halves of each input row
 *
 * Rows may be strided (row stride in elements); the elements of a row are contiguous.
 * Rows are spread over OpenMP threads only when there is enough work to pay for the team.
 *
 * The bf16 versions round wherever torch's bf16 ops store a result (and so wherever Hugging
 * Face's layers do): the residual sum, the normalised row before the weight, the product with
 * the weight; each rotary product and sum; silu(gate) before the product with up. In between
 * they work in fp32, as torch does inside each op, so they agree with the torch path bit for
 * bit except where fp32 evaluation order differs (the sum of squares, exp), which moves a
 * result by at most one bf16 step in rare cases.
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"

#define PARALLEL_MIN_ELEMS (1 << 16)

/* Element access per dtype: LD widens to fp32, ST narrows, RD is what storing and reloading
 * an intermediate result does (identity in fp32). */
static inline float ld_f32(float x) { return x; }
static inline float st_f32(float x) { return x; }
static inline float rd_f32(float x) { return x; }
#define ld_bf16 bf16_to_f32
#define st_bf16 f32_to_bf16
#define rd_bf16 round_bf16

/* x, residual, out: [rows, heads * dim] with row strides; each group of `dim` is normalised.
 * Rows and heads share one loop so that a few rows of many heads still spread over the
 * threads. */
#define DEFINE_ADD_RMS_NORM(NAME, T, LD, ST, RD)                                             \
    void NAME(const T *x, int64_t x_stride, T *residual, int64_t res_stride, const T *weight, \
              T *out, int64_t out_stride, int64_t rows, int64_t heads, int64_t dim,          \
              float eps, int num_threads) {                                                  \
        const int64_t groups = rows * heads;                                                 \
        _Pragma("omp parallel for num_threads(num_threads) if (groups * dim >= PARALLEL_MIN_ELEMS)") \
        for (int64_t g = 0; g < groups; g++) {                                               \
            const int64_t r = g / heads, off = (g % heads) * dim;                            \
            T *h = residual + r * res_stride + off;                                          \
            T *o = out + r * out_stride + off;                                               \
            float ss = 0.0f;                                                                 \
            if (x != 0) {                                                                    \
                const T *xr = x + r * x_stride + off;                                        \
                _Pragma("omp simd reduction(+ : ss)")                                        \
                for (int64_t i = 0; i < dim; i++) {                                          \
                    T s = ST(LD(h[i]) + LD(xr[i]));                                          \
                    h[i] = s;                                                                \
                    float f = LD(s);                                                         \
                    ss += f * f;                                                             \
                }                                                                            \
            } else {                                                                         \
                _Pragma("omp simd reduction(+ : ss)")                                        \
                for (int64_t i = 0; i < dim; i++) {                                          \
                    float f = LD(h[i]);                                                      \
                    ss += f * f;                                                             \
                }                                                                            \
            }                                                                                \
            float inv = 1.0f / sqrtf(ss / (float)dim + eps);                                 \
            _Pragma("omp simd")                                                              \
            for (int64_t i = 0; i < dim; i++) o[i] = ST(LD(weight[i]) * RD(LD(h[i]) * inv)); \
        }                                                                                    \
    }

/* cos_rows, sin_rows: [rows, head_dim / 2], the rows for each token's position. */
#define DEFINE_ROTARY(NAME, T, LD, ST, RD)                                                   \
    void NAME(T *x, int64_t row_stride, int64_t heads, int64_t head_dim, const T *cos_rows,   \
              const T *sin_rows, int64_t rows, int num_threads) {                            \
        const int64_t half = head_dim / 2;                                                   \
        _Pragma("omp parallel for num_threads(num_threads) if (rows * heads * head_dim >= PARALLEL_MIN_ELEMS)") \
        for (int64_t r = 0; r < rows; r++) {                                                 \
            const T *c = cos_rows + r * half;                                                \
            const T *s = sin_rows + r * half;                                                \
            for (int64_t h = 0; h < heads; h++) {                                            \
                T *a = x + r * row_stride + h * head_dim;                                    \
                T *b = a + half;                                                             \
                _Pragma("omp simd")                                                          \
                for (int64_t i = 0; i < half; i++) {                                         \
                    float x1 = LD(a[i]), x2 = LD(b[i]), ci = LD(c[i]), si = LD(s[i]);        \
                    a[i] = ST(RD(x1 * ci) - RD(x2 * si));                                    \
                    b[i] = ST(RD(x2 * ci) + RD(x1 * si));                                    \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
    }

#define DEFINE_SILU_MUL(NAME, T, LD, ST, RD)                                                 \
    void NAME(const T *gate_up, int64_t in_stride, T *out, int64_t out_stride, int64_t rows,  \
              int64_t dim, int num_threads) {                                                \
        _Pragma("omp parallel for num_threads(num_threads) if (rows * dim >= PARALLEL_MIN_ELEMS)") \
        for (int64_t r = 0; r < rows; r++) {                                                 \
            const T *g = gate_up + r * in_stride;                                            \
            const T *u = g + dim;                                                            \
            T *o = out + r * out_stride;                                                     \
            _Pragma("omp simd")                                                              \
            for (int64_t i = 0; i < dim; i++) {                                              \
                float gi = LD(g[i]);                                                         \
                o[i] = ST(RD(gi / (1.0f + expf(-gi))) * LD(u[i]));                           \
            }                                                                                \
        }                                                                                    \
    }

DEFINE_ADD_RMS_NORM(kvf_add_rms_norm_f32, float, ld_f32, st_f32, rd_f32)
DEFINE_ADD_RMS_NORM(kvf_add_rms_norm_bf16, bf16_t, ld_bf16, st_bf16, rd_bf16)
DEFINE_ROTARY(kvf_rotary_f32, float, ld_f32, st_f32, rd_f32)
DEFINE_ROTARY(kvf_rotary_bf16, bf16_t, ld_bf16, st_bf16, rd_bf16)
DEFINE_SILU_MUL(kvf_silu_mul_f32, float, ld_f32, st_f32, rd_f32)
DEFINE_SILU_MUL(kvf_silu_mul_bf16, bf16_t, ld_bf16, st_bf16, rd_bf16)
