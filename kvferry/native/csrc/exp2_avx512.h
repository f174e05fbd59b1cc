/* 2^y on AVX-512 for the attention kernels' softmax: 2^f for f = y - round(y), in
 * [-0.5, 0.5], by a polynomial (coefficients c[0..n-1], highest power first), scaled by
 * 2^round(y) in one instruction (scalef), which also takes y far below the fp32 range to 0 or
 * a subnormal rather than to garbage. */
#ifndef KVF_EXP2_AVX512_H
#define KVF_EXP2_AVX512_H
#if defined(__x86_64__)
#include <immintrin.h>

/* Degree 3, minimax: 7.5e-5 relative, for probabilities rounded to bf16 (4e-3). */
__attribute__((unused)) static const float EXP2_DEGREE3[4] = {5.51716648e-02f, 2.42611125e-01f,
                                                              6.93260968e-01f, 9.99928057e-01f};
/* Degree 5, minimax: 7.7e-8 relative, about 4 ulp of fp32 with its rounding. */
__attribute__((unused)) static const float EXP2_DEGREE5[6] = {
    1.32761022e-3f, 9.67541430e-3f, 5.55071309e-2f, 2.40221217e-1f, 6.93146944e-1f,
    1.00000012f};

__attribute__((target("avx512f"), always_inline, unused)) static inline __m512
exp2_avx512(__m512 y, const float *c, int n) {
    const __m512 k = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(y, k);
    __m512 p = _mm512_set1_ps(c[0]);
    for (int i = 1; i < n; i++) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[i]));
    return _mm512_scalef_ps(p, k);
}
#endif
#endif
