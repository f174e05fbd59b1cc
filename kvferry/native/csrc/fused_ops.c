/*
 * Fused elementwise steps of a decoder layer, fp32 and bf16, for CPU engines.
 *
 * In torch each of these is 3-8 small ops (an RMSNorm is pow, mean, add, rsqrt, mul, mul),
 * each of which dispatches, allocates and makes a pass over memory; at decode sizes the
 * dispatch dominates and at prefill sizes the passes do. Here each is one pass per row.
 *
 *   add_rms_norm   residual += x (unless x is NULL); out = rms_norm(residual) * weight
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

void kvf_add_rms_norm_f32(const float *x, int64_t x_stride, float *residual,
                          int64_t res_stride, const float *weight, float *out,
                          int64_t out_stride, int64_t rows, int64_t dim, float eps,
                          int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * dim >= PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        float *h = residual + r * res_stride;
        float *o = out + r * out_stride;
        float ss = 0.0f;
        if (x != 0) {
            const float *xr = x + r * x_stride;
#pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < dim; i++) {
                float s = h[i] + xr[i];
                h[i] = s;
                ss += s * s;
            }
        } else {
#pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < dim; i++) ss += h[i] * h[i];
        }
        float inv = 1.0f / sqrtf(ss / (float)dim + eps);
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) o[i] = weight[i] * (h[i] * inv);
    }
}

/* cos_rows, sin_rows: [rows, head_dim / 2], the rows for each token's position. */
void kvf_rotary_f32(float *x, int64_t row_stride, int64_t heads, int64_t head_dim,
                    const float *cos_rows, const float *sin_rows, int64_t rows, int num_threads) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) \
    if (rows * heads * head_dim >= PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos_rows + r * half;
        const float *s = sin_rows + r * half;
        for (int64_t h = 0; h < heads; h++) {
            float *a = x + r * row_stride + h * head_dim;
            float *b = a + half;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                float x1 = a[i], x2 = b[i];
                a[i] = x1 * c[i] - x2 * s[i];
                b[i] = x2 * c[i] + x1 * s[i];
            }
        }
    }
}

void kvf_silu_mul_f32(const float *gate_up, int64_t in_stride, float *out,
                      int64_t out_stride, int64_t rows, int64_t dim, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * dim >= PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * in_stride;
        const float *u = g + dim;
        float *o = out + r * out_stride;
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

void kvf_add_rms_norm_bf16(const bf16_t *x, int64_t x_stride, bf16_t *residual,
                           int64_t res_stride, const bf16_t *weight, bf16_t *out,
                           int64_t out_stride, int64_t rows, int64_t dim, float eps,
                           int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * dim >= PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        bf16_t *h = residual + r * res_stride;
        bf16_t *o = out + r * out_stride;
        float ss = 0.0f;
        if (x != 0) {
            const bf16_t *xr = x + r * x_stride;
#pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < dim; i++) {
                bf16_t s = f32_to_bf16(bf16_to_f32(h[i]) + bf16_to_f32(xr[i]));
                h[i] = s;
                float f = bf16_to_f32(s);
                ss += f * f;
            }
        } else {
#pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < dim; i++) {
                float f = bf16_to_f32(h[i]);
                ss += f * f;
            }
        }
        float inv = 1.0f / sqrtf(ss / (float)dim + eps);
#pragma omp simd
        for (int64_t i = 0; i < dim; i++)
            o[i] = f32_to_bf16(bf16_to_f32(weight[i]) * round_bf16(bf16_to_f32(h[i]) * inv));
    }
}

void kvf_rotary_bf16(bf16_t *x, int64_t row_stride, int64_t heads, int64_t head_dim,
                     const bf16_t *cos_rows, const bf16_t *sin_rows, int64_t rows,
                     int num_threads) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) \
    if (rows * heads * head_dim >= PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const bf16_t *c = cos_rows + r * half;
        const bf16_t *s = sin_rows + r * half;
        for (int64_t h = 0; h < heads; h++) {
            bf16_t *a = x + r * row_stride + h * head_dim;
            bf16_t *b = a + half;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                float x1 = bf16_to_f32(a[i]), x2 = bf16_to_f32(b[i]);
                float ci = bf16_to_f32(c[i]), si = bf16_to_f32(s[i]);
                a[i] = f32_to_bf16(round_bf16(x1 * ci) - round_bf16(x2 * si));
                b[i] = f32_to_bf16(round_bf16(x2 * ci) + round_bf16(x1 * si));
            }
        }
    }
}

void kvf_silu_mul_bf16(const bf16_t *gate_up, int64_t in_stride, bf16_t *out,
                       int64_t out_stride, int64_t rows, int64_t dim, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * dim >= PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const bf16_t *g = gate_up + r * in_stride;
        const bf16_t *u = g + dim;
        bf16_t *o = out + r * out_stride;
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) {
            float gi = bf16_to_f32(g[i]);
            o[i] = f32_to_bf16(round_bf16(gi / (1.0f + expf(-gi))) * bf16_to_f32(u[i]));
        }
    }
}
