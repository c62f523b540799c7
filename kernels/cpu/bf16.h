/* bf16 <-> fp32 for the C kernels of this package (bf16 is the top half of an fp32). */
#pragma once
#include <stdint.h>

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)x << 16;
    return c.f;
}

/* round to nearest even; NaN stays NaN */
static inline uint16_t f32_to_bf16(float f) {
    union { uint32_t u; float f; } c;
    c.f = f;
    if ((c.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((c.u >> 16) | 0x40);
    c.u += 0x7fffu + ((c.u >> 16) & 1u);
    return (uint16_t)(c.u >> 16);
}

static inline float f32_id(float x) { return x; }
