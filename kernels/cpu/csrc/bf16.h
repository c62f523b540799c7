/* bf16 <-> fp32 for the C kernels of this package (bf16 is the top half of an fp32). */
#pragma once
#include <stdint.h>

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)x << 16;
    return c.f;
}

/* round to nearest even; NaN stays NaN (quieted). Branch-free, so that loops over it vectorise. */
static inline uint16_t f32_to_bf16(float f) {
    union { uint32_t u; float f; } c;
    c.f = f;
    const uint32_t rounded = (c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16, quiet = (c.u >> 16) | 0x40u;
    return (uint16_t)((c.u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
}

static inline float f32_id(float x) { return x; }
