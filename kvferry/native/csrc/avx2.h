/*
 * AVX2 helpers shared by the C kernels (the linear kernels, decode attention). Compiled
 * through target attributes, so a file built for any x86-64 level may include them; only
 * code that runs on an AVX2 + FMA CPU may call them.
 */
#ifndef KVF_AVX2_H
#define KVF_AVX2_H

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#include <stdint.h>

#define KVF_AVX2_FN __attribute__((target("avx2,fma"), always_inline)) static inline

/* The sum of the 8 lanes. */
KVF_AVX2_FN float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 8 bf16 as 8 fp32, in order: zero-extended to 32 bits, then shifted into the top half (a
 * bf16 is the top half of an fp32). */
KVF_AVX2_FN __m256 widen256(const uint16_t *p) {
    __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}
#endif

#endif
