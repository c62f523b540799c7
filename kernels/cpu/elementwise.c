/* Fused elementwise ops of the Llama forward for CPU, each one pass over memory instead of several torch
 * ops (each with its own temporaries). Rounding matches the torch ops they replace in the model dtype:
 * a bf16 result is rounded to nearest even wherever the torch version stores a bf16 tensor.
 *
 * rms_norm:  out[t] = w * to_dtype(x[t] / sqrt(mean(x[t]^2) + eps))      x, out: [T, H] rows at a stride
 * add_rms_norm: x[t] <- to_dtype(x[t] + d[t]) in place (the residual add), then out[t] = rms_norm(x[t])
 * silu_mul:  out[t, i] = silu(gu[t, i]) * gu[t, I + i]                    gu: [T, 2I]; out: [T, I]
 * rope:      x[t, h] <- x * cos[t] + rotate_half(x) * sin[t] in place     x: [T, heads, d]; cos, sin: [T, d]
 * write_kv:  the K and V rows ([T, n] at a stride) of token t into page pages[t], row offs[t] of the
 *            caches (a page's block is [block_size, n] at cache + page * page_stride)
 * Parallel over rows with OpenMP.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

static inline float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

#define DEFINE_OPS(SUFFIX, T, LOAD, STORE, ROUND)                                                            \
void rms_norm_##SUFFIX(const T *x, int64_t x_stride, const T *w, T *out, int64_t out_stride, int64_t rows,  \
                       int H, float eps) {                                                                    \
    _Pragma("omp parallel for schedule(static)")                                                              \
    for (int64_t t = 0; t < rows; t++) {                                                                      \
        const T *xt = x + t * x_stride;                                                                       \
        float ss = 0.f;                                                                                       \
        _Pragma("omp simd reduction(+:ss)")                                                                   \
        for (int i = 0; i < H; i++) { const float v = LOAD(xt[i]); ss += v * v; }                            \
        const float inv = 1.f / sqrtf(ss / H + eps);                                                          \
        T *ot = out + t * out_stride;                                                                         \
        for (int i = 0; i < H; i++) ot[i] = STORE(LOAD(w[i]) * ROUND(LOAD(xt[i]) * inv));                     \
    }                                                                                                         \
}                                                                                                             \
                                                                                                              \
void add_rms_norm_##SUFFIX(T *x, int64_t x_stride, const T *d, int64_t d_stride, const T *w, T *out,             \
                           int64_t out_stride, int64_t rows, int H, float eps) {                              \
    _Pragma("omp parallel for schedule(static)")                                                              \
    for (int64_t t = 0; t < rows; t++) {                                                                      \
        T *xt = x + t * x_stride;                                                                             \
        const T *dt = d + t * d_stride;                                                                       \
        float ss = 0.f;                                                                                       \
        for (int i = 0; i < H; i++) {                                                                         \
            xt[i] = STORE(LOAD(xt[i]) + LOAD(dt[i]));                                                         \
            const float v = LOAD(xt[i]);                                                                      \
            ss += v * v;                                                                                      \
        }                                                                                                     \
        const float inv = 1.f / sqrtf(ss / H + eps);                                                          \
        T *ot = out + t * out_stride;                                                                         \
        for (int i = 0; i < H; i++) ot[i] = STORE(LOAD(w[i]) * ROUND(LOAD(xt[i]) * inv));                     \
    }                                                                                                         \
}                                                                                                             \
                                                                                                              \
void silu_mul_##SUFFIX(const T *gu, int64_t gu_stride, T *out, int64_t out_stride, int64_t rows, int I) {     \
    _Pragma("omp parallel for schedule(static)")                                                              \
    for (int64_t t = 0; t < rows; t++) {                                                                      \
        const T *g = gu + t * gu_stride, *u = g + I;                                                          \
        T *ot = out + t * out_stride;                                                                         \
        for (int i = 0; i < I; i++) {                                                                         \
            const float a = LOAD(g[i]);                                                                       \
            ot[i] = STORE(ROUND(a / (1.f + expf(-a))) * LOAD(u[i]));                                          \
        }                                                                                                     \
    }                                                                                                         \
}                                                                                                             \
                                                                                                              \
void rope_##SUFFIX(T *x, int64_t row_stride, int64_t rows, int heads, int d, const T *cos, const T *sin) {   \
    const int half = d / 2;                                                                                   \
    _Pragma("omp parallel for schedule(static)")                                                              \
    for (int64_t t = 0; t < rows; t++) {                                                                      \
        const T *c = cos + t * d, *s = sin + t * d;                                                           \
        for (int h = 0; h < heads; h++) {                                                                     \
            T *xh = x + t * row_stride + (int64_t)h * d;                                                      \
            for (int i = 0; i < half; i++) {                                                                  \
                const float x1 = LOAD(xh[i]), x2 = LOAD(xh[i + half]);                                        \
                const float lo = ROUND(x1 * LOAD(c[i])) + ROUND(-x2 * LOAD(s[i]));                            \
                const float hi = ROUND(x2 * LOAD(c[i + half])) + ROUND(x1 * LOAD(s[i + half]));               \
                xh[i] = STORE(lo);                                                                            \
                xh[i + half] = STORE(hi);                                                                     \
            }                                                                                                 \
        }                                                                                                     \
    }                                                                                                         \
}

void write_kv(const char *k, int64_t k_stride, const char *v, int64_t v_stride, char *k_cache, char *v_cache,
              int64_t page_stride, const int64_t *pages, const int64_t *offs, int64_t rows, int64_t row_bytes) {
    /* rows land on scattered pages: each copy waits on its own cache misses, so spread them */
    _Pragma("omp parallel for schedule(static) if (rows > 64)")
    for (int64_t t = 0; t < rows; t++) {
        const int64_t at = pages[t] * page_stride + offs[t] * row_bytes;
        memcpy(k_cache + at, k + t * k_stride, row_bytes);
        memcpy(v_cache + at, v + t * v_stride, row_bytes);
    }
}

DEFINE_OPS(bf16, uint16_t, bf16_to_f32, f32_to_bf16, round_bf16)
DEFINE_OPS(f32, float, f32_id, f32_id, f32_id)
