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
 * bf16 has explicit AVX-512 versions where the CPU converts to bf16 natively (AVX512_BF16);
 * elsewhere the portable loops, which the compiler vectorises.
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

/* KVF_PORTABLE_BF16 keeps the portable loops (tests build it so, to check them everywhere). */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && \
    !defined(KVF_PORTABLE_BF16)
#include <immintrin.h>
#define KVF_BF16_AVX512 1
#endif

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

/* One head rotated: dst = rotate(src) by the half-width rows c and s, from pair `from` on
 * (0: the whole head; more: a vector loop's tail); dst may be src. */
#define DEFINE_ROTATE_HEAD(NAME, T, LD, ST, RD)                                              \
    static inline void NAME(const T *src, T *dst, const T *c, const T *s, int64_t half,      \
                            int64_t from) {                                                  \
        _Pragma("omp simd")                                                                  \
        for (int64_t i = from; i < half; i++) {                                              \
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
                ROTATE(a, a, cos_rows + r * half, sin_rows + r * half, half, 0);             \
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
            ROTATE(normed, a, cos_rows + r * half, sin_rows + r * half, half, 0);            \
        }                                                                                    \
    }

/* One row: o = silu(g) * u over dim elements. */
#define DEFINE_SILU_ROW(NAME, T, LD, ST, RD)                                                 \
    static inline void NAME(const T *g, const T *u, T *o, int64_t dim) {                      \
        _Pragma("omp simd")                                                                  \
        for (int64_t i = 0; i < dim; i++) {                                                  \
            float gi = LD(g[i]);                                                             \
            o[i] = ST(RD(gi / (1.0f + expf(-gi))) * LD(u[i]));                               \
        }                                                                                    \
    }

#define DEFINE_SILU_MUL(NAME, T, ROW)                                                        \
    void NAME(const T *gate_up, int64_t in_stride, T *out, int64_t out_stride, int64_t rows,  \
              int64_t dim, int num_threads) {                                                \
        _Pragma("omp parallel for num_threads(num_threads) if (rows * dim >= PARALLEL_MIN_ELEMS)") \
        for (int64_t r = 0; r < rows; r++) {                                                 \
            const T *g = gate_up + r * in_stride;                                            \
            ROW(g, g + dim, out + r * out_stride, dim);                                      \
        }                                                                                    \
    }

DEFINE_NORM_GROUP(norm_group_f32, float, ld_f32, st_f32, rd_f32)
DEFINE_NORM_GROUP(norm_group_bf16_scalar, bf16_t, ld_bf16, st_bf16, rd_bf16)
DEFINE_ROTATE_HEAD(rotate_head_f32, float, ld_f32, st_f32, rd_f32)
DEFINE_ROTATE_HEAD(rotate_head_bf16_scalar, bf16_t, ld_bf16, st_bf16, rd_bf16)
DEFINE_SILU_ROW(silu_mul_row_f32, float, ld_f32, st_f32, rd_f32)
DEFINE_SILU_ROW(silu_mul_row_bf16_scalar, bf16_t, ld_bf16, st_bf16, rd_bf16)

#ifdef KVF_BF16_AVX512
/* bf16 with AVX-512 and its bf16 conversions, 16 elements a vector. The auto-vectorised loops
 * above spend most of their instructions on widening and on rounding in integer arithmetic;
 * vcvtneps2bf16 rounds to nearest even in one instruction (it also reads and writes fp32
 * denormals as zero, which torch does not: a bf16 step apart at worst, below 1e-38). The
 * exponential is a degree-6 polynomial on [-ln2/2, ln2/2] scaled by 2^k (relative error
 * under 3e-7), the reciprocal rcp14 with one Newton step. Tails take the scalar loops. */
static inline __m512 v_widen(__m256i b) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}
static inline __m256i v_narrow(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }
static inline __m512 v_ld(const bf16_t *p) {
    return v_widen(_mm256_loadu_si256((const __m256i *)p));
}
static inline void v_st(bf16_t *p, __m512 x) { _mm256_storeu_si256((__m256i *)p, v_narrow(x)); }
static inline __m512 v_rd(__m512 x) { return v_widen(v_narrow(x)); }
static inline __m512 v_exp(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-87.0f));
    __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(1.42860682030941723e-6f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, k);
}
static inline __m512 v_silu(__m512 g) {
    __m512 d = _mm512_add_ps(_mm512_set1_ps(1.0f), v_exp(_mm512_sub_ps(_mm512_setzero_ps(), g)));
    __m512 r = _mm512_rcp14_ps(d);
    r = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.0f)));
    return _mm512_mul_ps(g, r);
}

static inline void norm_group_bf16(const bf16_t *x, bf16_t *h, const bf16_t *weight, bf16_t *o,
                                   int64_t dim, float eps) {
    const int64_t vec = dim & ~(int64_t)15;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < vec; i += 16) {
        __m512 v = v_ld(h + i);
        if (x != 0) {
            const __m256i sum = v_narrow(_mm512_add_ps(v, v_ld(x + i)));
            _mm256_storeu_si256((__m256i *)(h + i), sum);
            v = v_widen(sum);
        }
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    float ss = _mm512_reduce_add_ps(acc);
    for (int64_t i = vec; i < dim; i++) {
        if (x != 0) h[i] = f32_to_bf16(bf16_to_f32(h[i]) + bf16_to_f32(x[i]));
        float f = bf16_to_f32(h[i]);
        ss += f * f;
    }
    const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
    const __m512 vinv = _mm512_set1_ps(inv);
    for (int64_t i = 0; i < vec; i += 16)
        v_st(o + i, _mm512_mul_ps(v_ld(weight + i), v_rd(_mm512_mul_ps(v_ld(h + i), vinv))));
    for (int64_t i = vec; i < dim; i++)
        o[i] = f32_to_bf16(bf16_to_f32(weight[i]) * round_bf16(bf16_to_f32(h[i]) * inv));
}

static inline void rotate_head_bf16(const bf16_t *src, bf16_t *dst, const bf16_t *c,
                                    const bf16_t *s, int64_t half, int64_t from) {
    int64_t i = from;
    for (; i + 16 <= half; i += 16) {
        __m512 x1 = v_ld(src + i), x2 = v_ld(src + half + i), ci = v_ld(c + i), si = v_ld(s + i);
        __m512 a = _mm512_sub_ps(v_rd(_mm512_mul_ps(x1, ci)), v_rd(_mm512_mul_ps(x2, si)));
        __m512 b = _mm512_add_ps(v_rd(_mm512_mul_ps(x2, ci)), v_rd(_mm512_mul_ps(x1, si)));
        v_st(dst + i, a);
        v_st(dst + half + i, b);
    }
    rotate_head_bf16_scalar(src, dst, c, s, half, i);
}

static inline void silu_mul_row_bf16(const bf16_t *g, const bf16_t *u, bf16_t *o, int64_t dim) {
    const int64_t vec = dim & ~(int64_t)15;
    for (int64_t i = 0; i < vec; i += 16)
        v_st(o + i, _mm512_mul_ps(v_rd(v_silu(v_ld(g + i))), v_ld(u + i)));
    silu_mul_row_bf16_scalar(g + vec, u + vec, o + vec, dim - vec);
}
#else
#define norm_group_bf16 norm_group_bf16_scalar
#define rotate_head_bf16 rotate_head_bf16_scalar
#define silu_mul_row_bf16 silu_mul_row_bf16_scalar
#endif
DEFINE_ADD_RMS_NORM(kvf_add_rms_norm_f32, float, norm_group_f32)
DEFINE_ADD_RMS_NORM(kvf_add_rms_norm_bf16, bf16_t, norm_group_bf16)
DEFINE_ROTARY(kvf_rotary_f32, float, rotate_head_f32)
DEFINE_ROTARY(kvf_rotary_bf16, bf16_t, rotate_head_bf16)
DEFINE_QK_NORM_ROTARY(kvf_qk_norm_rotary_f32, float, norm_group_f32, rotate_head_f32)
DEFINE_QK_NORM_ROTARY(kvf_qk_norm_rotary_bf16, bf16_t, norm_group_bf16, rotate_head_bf16)
DEFINE_SILU_MUL(kvf_silu_mul_f32, float, silu_mul_row_f32)
DEFINE_SILU_MUL(kvf_silu_mul_bf16, bf16_t, silu_mul_row_bf16)
