/*
 * Fused elementwise steps of a decoder layer, fp32, for CPU engines.
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
 */
#include <math.h>
#include <stdint.h>

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
