/* An adapter's LoRA weights, straight from its safetensors file (memory-mapped), into the CPU kernels' group
 * layout (kernels/cpu/lora_pack.py) in one pass: converted to the model dtype, B transposed, scaled and, for
 * AVX512-BF16, paired by ranks. Each piece is one tensor:
 *   kind 0, A [rows = r, cols = in]:   dst[(k * G + g) * in + j]            = cvt(A[k, j])
 *   kind 1, B [rows = out, cols = r]:  dst[k * out + j]                      = cvt(cvt(B[j, k]) * scale)
 *   kind 2, B, paired:                 dst[(k / 2) * 2 * out + 2 * j + k % 2] = cvt(cvt(B[j, k]) * scale)
 * cvt rounds to the model dtype (bf16: to nearest even, as torch's .to(); the product in fp32, as torch's
 * bf16 * scalar), so the bits are those of the torch path (GroupPacker.place). Values are checked after the
 * conversion (before the scale), as there: NaN or infinity in the model dtype fails the piece.
 * Returns 0, or -(1 + i) for the first piece i holding a non-finite value (the rest not written).
 */
#include "loraplex_kernels.h"
#include <stdint.h>

#include "bf16.h"

typedef struct pack_piece {
    int64_t src;        /* byte offset of the tensor in `data` */
    int64_t dst;        /* element offset of its block in `out` */
    int32_t rows, cols;
    int32_t kind, G, g;
    int32_t src_dtype;  /* 0 fp32, 1 bf16, 2 fp16 */
    float scale;
} pack_piece;

static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    union { uint32_t u; float f; } c;
    if (exp == 0x1fu) {
        c.u = sign | 0x7f800000u | (man << 13);                  /* inf, NaN */
    } else if (exp) {
        c.u = sign | ((exp + 112u) << 23) | (man << 13);         /* normal */
    } else {
        c.f = (float)man * 5.9604644775390625e-8f;               /* subnormal: man * 2^-24, exact */
        c.u |= sign;
    }
    return c.f;
}

static inline float load_f32(const void *p, int64_t i) { return ((const float *)p)[i]; }
static inline float load_bf16(const void *p, int64_t i) { return bf16_to_f32(((const uint16_t *)p)[i]); }
static inline float load_f16(const void *p, int64_t i) { return f16_to_f32(((const uint16_t *)p)[i]); }

/* the model dtype: bf16 (rounded to nearest even) or fp32; `bad` collects the exponent bits of a
 * non-finite value (bit tests: -ffast-math may drop isfinite()) */
static inline uint16_t to_bf16(float v, uint32_t *bad) {
    const uint16_t h = f32_to_bf16(v);
    *bad |= (h & 0x7f80u) == 0x7f80u;
    return h;
}
static inline float to_f32(float v, uint32_t *bad) {
    union { uint32_t u; float f; } c;
    c.f = v;
    *bad |= (c.u & 0x7f800000u) == 0x7f800000u;
    return v;
}
static inline float bf16_val(uint16_t h) { return bf16_to_f32(h); }
static inline float f32_val(float v) { return v; }

#define JB 64   /* B rows per tile: converted into an L1-resident tile, then written out transposed */

/* A [rows = r, cols = in] and B [rows = out, cols = r] of one source dtype into one model dtype. B's JB rows
 * of all r ranks are one contiguous run of the source: converted in one vectorised pass into `tile`, then
 * each rank's column of the tile becomes a contiguous run of Bt (or, paired, ranks 2p and 2p + 1 one run of
 * element pairs) */
#define DEFINE_PACK(NAME, LOAD, T, CVT, VAL)                                                                   \
static uint32_t NAME##_a(const void *restrict src, const pack_piece *p, T *restrict out) {                     \
    uint32_t bad = 0;                                                                                          \
    for (int64_t k = 0; k < p->rows; k++) {                                                                    \
        T *restrict d = out + p->dst + (k * p->G + p->g) * p->cols;                                            \
        const int64_t s = k * p->cols;                                                                         \
        for (int64_t j = 0; j < p->cols; j++) d[j] = CVT(LOAD(src, s + j), &bad);                              \
    }                                                                                                          \
    return bad;                                                                                                \
}                                                                                                              \
static uint32_t NAME##_b(const void *restrict src, const pack_piece *p, T *restrict out) {                     \
    const int64_t n_out = p->rows, r = p->cols;                                                                \
    const float scale = p->scale;                                                                              \
    uint32_t bad = 0, unused = 0;                                                                              \
    T tile[JB * 64 + 1];                                                                                       \
    for (int64_t j0 = 0; j0 < n_out; j0 += JB) {                                                               \
        const int64_t nj = j0 + JB < n_out ? JB : n_out - j0;                                                  \
        for (int64_t c0 = 0; c0 < r; c0 += 64) {                                                               \
            const int64_t nc = c0 + 64 < r ? 64 : r - c0;                                                      \
            if (nc == r) {                  /* the tile is one contiguous run of the source */               \
                const int64_t s = j0 * r;                                                                      \
                for (int64_t t = 0; t < nj * r; t++)                                                           \
                    tile[t] = CVT(VAL(CVT(LOAD(src, s + t), &bad)) * scale, &unused);                          \
            } else {                                                                                           \
                for (int64_t j = 0; j < nj; j++)                                                               \
                    for (int64_t c = 0; c < nc; c++)                                                           \
                        tile[j * nc + c] = CVT(VAL(CVT(LOAD(src, (j0 + j) * r + c0 + c), &bad)) * scale,       \
                                               &unused);                                                       \
            }                                                                                                  \
            if (p->kind == 1) {                                                                                \
                for (int64_t c = 0; c < nc; c++) {                                                             \
                    T *restrict d = out + p->dst + (c0 + c) * n_out + j0;                                      \
                    for (int64_t j = 0; j < nj; j++) d[j] = tile[j * nc + c];                                  \
                }                                                                                              \
            } else {                                                                                           \
                for (int64_t c = 0; c < nc; c += 2) {                                                          \
                    T *restrict d = out + p->dst + ((c0 + c) / 2) * 2 * n_out + 2 * j0;                        \
                    if (c + 1 < nc) {                                                                          \
                        for (int64_t j = 0; j < nj; j++) {                                                     \
                            d[2 * j] = tile[j * nc + c];                                                       \
                            d[2 * j + 1] = tile[j * nc + c + 1];                                               \
                        }                                                                                      \
                    } else {                                                                                   \
                        for (int64_t j = 0; j < nj; j++) d[2 * j] = tile[j * nc + c];                          \
                    }                                                                                          \
                }                                                                                              \
            }                                                                                                  \
        }                                                                                                      \
    }                                                                                                          \
    return bad;                                                                                                \
}

DEFINE_PACK(f32_bf16, load_f32, uint16_t, to_bf16, bf16_val)
DEFINE_PACK(bf16_bf16, load_bf16, uint16_t, to_bf16, bf16_val)
DEFINE_PACK(f16_bf16, load_f16, uint16_t, to_bf16, bf16_val)
DEFINE_PACK(f32_f32, load_f32, float, to_f32, f32_val)
DEFINE_PACK(bf16_f32, load_bf16, float, to_f32, f32_val)
DEFINE_PACK(f16_f32, load_f16, float, to_f32, f32_val)

static uint32_t pack_piece_bf16(const uint8_t *src, const pack_piece *p, void *out) {
    uint16_t *o = (uint16_t *)out;
    switch (p->src_dtype * 2 + (p->kind != 0)) {
    case 0: return f32_bf16_a(src, p, o);
    case 1: return f32_bf16_b(src, p, o);
    case 2: return bf16_bf16_a(src, p, o);
    case 3: return bf16_bf16_b(src, p, o);
    case 4: return f16_bf16_a(src, p, o);
    default: return f16_bf16_b(src, p, o);
    }
}

static uint32_t pack_piece_f32(const uint8_t *src, const pack_piece *p, void *out) {
    float *o = (float *)out;
    switch (p->src_dtype * 2 + (p->kind != 0)) {
    case 0: return f32_f32_a(src, p, o);
    case 1: return f32_f32_b(src, p, o);
    case 2: return bf16_f32_a(src, p, o);
    case 3: return bf16_f32_b(src, p, o);
    case 4: return f16_f32_a(src, p, o);
    default: return f16_f32_b(src, p, o);
    }
}

/* pieces [n] of `data` (the file, from its first byte) into `out` (the flat packed adapter, zeroed, in bf16
 * when `bf16` else fp32) */
int pack_lora(const uint8_t *data, const pack_piece *pieces, int n, void *out, int bf16) {
    for (int i = 0; i < n; i++) {
        const pack_piece *p = pieces + i;
        const uint32_t bad = bf16 ? pack_piece_bf16(data + p->src, p, out) : pack_piece_f32(data + p->src, p, out);
        if (bad) return -(1 + i);
    }
    return 0;
}
