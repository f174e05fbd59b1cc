/* A 16 x 16 transpose of 32-bit elements in AVX-512 registers: r[i] holds row i on entry and
 * column i on return. For the kernels that turn rows into lanes (fp32 queries and outputs,
 * bf16 key pairs) without a scalar load and store per element. */
#ifndef KVF_TRANSPOSE16_H
#define KVF_TRANSPOSE16_H
#if defined(__x86_64__)
#include <immintrin.h>

__attribute__((target("avx512f"), always_inline, unused)) static inline void
transpose16(__m512i *r) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        u[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i + 0], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i + 0], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    /* u[4i + k], 128-bit chunk g: column 4g + k of rows 4i .. 4i + 3. */
    for (int k = 0; k < 4; k++) {
        const __m512i a = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x88);
        const __m512i b = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xDD);
        const __m512i c = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x88);
        const __m512i e = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xDD);
        r[k] = _mm512_shuffle_i32x4(a, c, 0x88);
        r[k + 8] = _mm512_shuffle_i32x4(a, c, 0xDD);
        r[k + 4] = _mm512_shuffle_i32x4(b, e, 0x88);
        r[k + 12] = _mm512_shuffle_i32x4(b, e, 0xDD);
    }
}
#endif
#endif
