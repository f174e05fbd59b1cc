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
 *   qk_norm_rotary Qwen3's per-head q/k norm and then rotary, in place (one call for both)
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

/* One group of `dim` elements: h += x (unless x is NULL), then o = rms_norm(h) * weight. */
#define DEFINE_NORM_GROUP(NAME, T, LD, ST, RD)                                               \
    static inline void NAME(const T *x, T *h, const T *weight, T *o, int64_t dim, float eps) { \
        float ss = 0.0f;                                                                     \
        if (x != 0) {                                                                        \
            _Pragma("omp simd reduction(+ : ss)")                                            \
            for (int64_t i = 0; i < dim; i++) {                                              \
                T s = ST(LD(h[i]) + LD(x[i]));                                               \
                h[i] = s;                                                                    \
                float f = LD(s);                                                             \
                ss += f * f;                                                                 \
            }                                                                                \
        } else {                                                                             \
            _Pragma("omp simd reduction(+ : ss)")                                            \
            for (int64_t i = 0; i < dim; i++) {                                              \
                float f = LD(h[i]);                                                          \
                ss += f * f;                                                                 \
            }                                                                                \
        }                                                                                    \
        float inv = 1.0f / sqrtf(ss / (float)dim + eps);                                     \
        _Pragma("omp simd")                                                                  \
        for (int64_t i = 0; i < dim; i++) o[i] = ST(LD(weight[i]) * RD(LD(h[i]) * inv));     \
    }

/* One head rotated: dst = rotate(src) by the half-width rows c and s; dst may be src. */
#define DEFINE_ROTATE_HEAD(NAME, T, LD, ST, RD)                                              \
    static inline void NAME(const T *src, T *dst, const T *c, const T *s, int64_t half) {   \
        _Pragma("omp simd")                                                                  \
        for (int64_t i = 0; i < half; i++) {                                                 \
            float x1 = LD(src[i]), x2 = LD(src[half + i]), ci = LD(c[i]), si = LD(s[i]);     \
            dst[i] = ST(RD(x1 * ci) - RD(x2 * si));                                          \
            dst[half + i] = ST(RD(x2 * ci) + RD(x1 * si));                                   \
        }                                                                                    \
    }

/* x, residual, out: [rows, heads * dim] with row strides; each group of `dim` is normalised.
 * Rows and heads share one loop so that a few rows of many heads still spread over the
 * threads. */
#define DEFINE_ADD_RMS_NORM(NAME, T, GROUP)                                                  \
    void NAME(const T *x, int64_t x_stride, T *residual, int64_t res_stride, const T *weight, \
              T *out, int64_t out_stride, int64_t rows, int64_t heads, int64_t dim,          \
              float eps, int num_threads) {                                                  \
        const int64_t groups = rows * heads;                                                 \
        _Pragma("omp parallel for num_threads(num_threads) if (groups * dim >= PARALLEL_MIN_ELEMS)") \
        for (int64_t g = 0; g < groups; g++) {                                               \
            const int64_t r = g / heads, off = (g % heads) * dim;                            \
            GROUP(x != 0 ? x + r * x_stride + off : 0, residual + r * res_stride + off,      \
                  weight, out + r * out_stride + off, dim, eps);                             \
        }                                                                                    \
    }

/* cos_rows, sin_rows: [rows, head_dim / 2], the rows for each token's position. */
#define DEFINE_ROTARY(NAME, T, ROTATE)                                                       \
    void NAME(T *x, int64_t row_stride, int64_t heads, int64_t head_dim, const T *cos_rows,   \
              const T *sin_rows, int64_t rows, int num_threads) {                            \
        const int64_t half = head_dim / 2;                                                   \
        _Pragma("omp parallel for num_threads(num_threads) if (rows * heads * head_dim >= PARALLEL_MIN_ELEMS)") \
        for (int64_t r = 0; r < rows; r++) {                                                 \
            for (int64_t h = 0; h < heads; h++) {                                            \
                T *a = x + r * row_stride + h * head_dim;                                    \
                ROTATE(a, a, cos_rows + r * half, sin_rows + r * half, half);                \
            }                                                                                \
        }                                                                                    \
    }

/* Qwen3's attention inputs in place: x's rows hold q_heads query heads, then k_heads key
 * heads, of head_dim each; every head is RMS-normalised with its weight (q_weight or
 * k_weight, [head_dim]), then rotated. The same roundings as add_rms_norm (heads, x NULL)
 * followed by rotary. head_dim is at most MAX_HEAD_DIM. */
#define MAX_HEAD_DIM 1024
#define DEFINE_QK_NORM_ROTARY(NAME, T, GROUP, ROTATE)                                        \
    void NAME(T *x, int64_t row_stride, int64_t q_heads, int64_t k_heads, int64_t head_dim,  \
              const T *q_weight, const T *k_weight, float eps, const T *cos_rows,            \
              const T *sin_rows, int64_t rows, int num_threads) {                            \
        const int64_t half = head_dim / 2, heads = q_heads + k_heads;                        \
        _Pragma("omp parallel for num_threads(num_threads) if (rows * heads * head_dim >= PARALLEL_MIN_ELEMS)") \
        for (int64_t g = 0; g < rows * heads; g++) {                                         \
            const int64_t r = g / heads, h = g % heads;                                      \
            T normed[MAX_HEAD_DIM];                                                          \
            T *a = x + r * row_stride + h * head_dim;                                        \
            GROUP(0, a, h < q_heads ? q_weight : k_weight, normed, head_dim, eps);           \
            ROTATE(normed, a, cos_rows + r * half, sin_rows + r * half, half);               \
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

DEFINE_NORM_GROUP(norm_group_f32, float, ld_f32, st_f32, rd_f32)
DEFINE_NORM_GROUP(norm_group_bf16, bf16_t, ld_bf16, st_bf16, rd_bf16)
DEFINE_ROTATE_HEAD(rotate_head_f32, float, ld_f32, st_f32, rd_f32)
DEFINE_ROTATE_HEAD(rotate_head_bf16, bf16_t, ld_bf16, st_bf16, rd_bf16)
DEFINE_ADD_RMS_NORM(kvf_add_rms_norm_f32, float, norm_group_f32)
DEFINE_ADD_RMS_NORM(kvf_add_rms_norm_bf16, bf16_t, norm_group_bf16)
DEFINE_ROTARY(kvf_rotary_f32, float, rotate_head_f32)
DEFINE_ROTARY(kvf_rotary_bf16, bf16_t, rotate_head_bf16)
DEFINE_QK_NORM_ROTARY(kvf_qk_norm_rotary_f32, float, norm_group_f32, rotate_head_f32)
DEFINE_QK_NORM_ROTARY(kvf_qk_norm_rotary_bf16, bf16_t, norm_group_bf16, rotate_head_bf16)
DEFINE_SILU_MUL(kvf_silu_mul_f32, float, ld_f32, st_f32, rd_f32)
DEFINE_SILU_MUL(kvf_silu_mul_bf16, bf16_t, ld_bf16, st_bf16, rd_bf16)
