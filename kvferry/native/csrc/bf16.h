/* bf16 <-> fp32 for the C kernels: bf16 is the top half of an fp32; narrowing rounds to
 * nearest even, as torch does, and keeps NaNs quiet. */
#ifndef KVF_BF16_H
#define KVF_BF16_H
#include <stdint.h>
#include <string.h>

typedef uint16_t bf16_t;

static inline float bf16_to_f32(bf16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline bf16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

/* The value torch's bf16 ops store for an fp32 result: rounded to bf16 and widened back. */
static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }
#endif
