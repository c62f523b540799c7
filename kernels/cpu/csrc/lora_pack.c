/* An adapter's LoRA weights, straight from its safetensors file (memory-mapped), into the CPU kernels' group
 * layout (kernels/cpu/lora_pack.py) in one pass: converted to the model dtype, B transposed, scaled and, for
 * AVX512-BF16, paired by ranks. Each piece is one tensor:
 *   kind 0, A [rows = r, cols = in]:   dst[(k * G + g) * in + j]            = cvt(A[k, j])
 *           (rows = 1, G = 1: a run of `cols` values, as the row-major layout of kernels/lora_layout.py
 *           writes every tensor: any alignment)
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
#if defined(__AVX512BW__) || defined(__AVX2__)
#include <immintrin.h>
#endif

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

#ifdef __AVX512BW__
/* The pieces into bf16 with AVX-512 (from fp32, bf16 or fp16 files, each value widened to fp32 exactly) and
 * non-temporal stores (the packed adapter is not read again before a step streams it in: writing around the
 * caches saves reading every destination line first). f32_to_bf16's rounding, 16 at a time: the same bits. */
static inline __m256i cvt16_bf16(__m512 v, __mmask16 *bad) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                                              _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))), 16);
    const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    const __m512i h = _mm512_mask_blend_epi32(nan, rounded, quiet);
    *bad |= _mm512_cmpeq_epi32_mask(_mm512_and_si512(h, _mm512_set1_epi32(0x7f80)), _mm512_set1_epi32(0x7f80));
    return _mm512_cvtepi32_epi16(h);
}

#define PF_AHEAD 1024    /* source floats read ahead (4 KiB) */

/* 32 converted values -> 64 bytes at d (64-byte aligned): one streamed line */
static inline void put32(uint16_t *d, __m256i lo, __m256i hi) {
    _mm512_stream_si512((__m512i *)d, _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
}

/* 16 source values from element i as fp32 bits (exact: bf16 widened, fp16 converted) */
static inline __m512i load16_bits(const uint8_t *src, int src_dtype, int64_t i) {
    if (src_dtype == 0) return _mm512_loadu_si512(src + 4 * i);
    const __m256i h = _mm256_loadu_si256((const __m256i *)(src + 2 * i));
    if (src_dtype == 1) return _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
    return _mm512_castps_si512(_mm512_cvtph_ps(h));
}

/* kind 0 from any source dtype: each rank's row of `cols` (a multiple of 32, rows 64-byte aligned) */
static int a_stream_bf16(const uint8_t *restrict src, const pack_piece *p, uint16_t *restrict out, uint32_t *bad) {
    uint16_t *first = out + p->dst + (int64_t)p->g * p->cols;
    if (p->cols % 32 || ((uintptr_t)first | (uintptr_t)(p->G * p->cols * 2)) % 64) return 0;
    const int64_t item = p->src_dtype == 0 ? 4 : 2;
    __mmask16 b = 0;
    for (int64_t k = 0; k < p->rows; k++) {
        uint16_t *d = out + p->dst + (k * p->G + p->g) * p->cols;
        const uint8_t *s = src + k * p->cols * item;
        for (int64_t j = 0; j < p->cols; j += 32) {
            _mm_prefetch((const char *)(s + (j + PF_AHEAD) * item), _MM_HINT_T0);
            _mm_prefetch((const char *)(s + (j + PF_AHEAD + 16) * item), _MM_HINT_T0);
            put32(d + j, cvt16_bf16(_mm512_castsi512_ps(load16_bits(s, p->src_dtype, j)), &b),
                  cvt16_bf16(_mm512_castsi512_ps(load16_bits(s, p->src_dtype, j + 16)), &b));
        }
    }
    *bad = b != 0;
    return 1;
}

/* kind 0 with rows = G = 1 from fp32: a run of cols values at any 2-byte alignment (the row-major layout's
 * tensors): to the first 64-byte boundary and past the last one value by value, between them streamed */
static int f32_bf16_run_stream(const float *restrict src, const pack_piece *p, uint16_t *restrict out,
                               uint32_t *bad) {
    if (p->rows != 1 || p->G != 1) return 0;
    uint16_t *d = out + p->dst;
    const int64_t n = p->cols;
    int64_t head = (int64_t)((64 - (uintptr_t)d % 64) % 64) / 2;
    if (head > n) head = n;
    uint32_t b = 0;
    for (int64_t j = 0; j < head; j++) d[j] = to_bf16(src[j], &b);
    __mmask16 m = 0;
    int64_t j = head;
    for (; j + 32 <= n; j += 32) {
        _mm_prefetch((const char *)(src + j + PF_AHEAD), _MM_HINT_T0);
        _mm_prefetch((const char *)(src + j + PF_AHEAD + 16), _MM_HINT_T0);
        put32(d + j, cvt16_bf16(_mm512_loadu_ps(src + j), &m), cvt16_bf16(_mm512_loadu_ps(src + j + 16), &m));
    }
    for (; j < n; j++) d[j] = to_bf16(src[j], &b);
    *bad = b != 0 || m != 0;
    return 1;
}

/* f32_to_bf16's rounding of 16 values, left in the high half of each 32-bit lane (the low half is junk):
 * exact for every finite value and for infinity; a NaN may come out as another value (callers refuse NaN) */
static inline __m512i round_hi(__m512i u) {
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    return _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
}

/* bf16(bf16(x) * scale) of 32 fp32 values (u0: the first 16, u1: the next), in order, for a finite scale: the
 * bits of cvt16_bf16's two conversions. bad collects the lanes whose first conversion is NaN or infinite
 * (|x| at or above 0x7f7f8000 rounds to infinity); the values then do not matter (the piece fails). The
 * product of a finite bf16 and a finite scale is never NaN, so round_hi is exact there. */
static inline __m512i scaled32_bf16(__m512i u0, __m512i u1, __m512 scale, __mmask16 *bad) {
    const __m512i mag = _mm512_set1_epi32(0x7fffffff), big = _mm512_set1_epi32(0x7f7f8000);
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
    *bad |= _mm512_cmpge_epu32_mask(_mm512_and_si512(u0, mag), big) | _mm512_cmpge_epu32_mask(_mm512_and_si512(u1, mag), big);
    const __m512 v0 = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_and_si512(round_hi(u0), hi)), scale);
    const __m512 v1 = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_and_si512(round_hi(u1), hi)), scale);
    const __m512i odd = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33,
                                         31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    return _mm512_permutex2var_epi16(round_hi(_mm512_castps_si512(v0)), odd, round_hi(_mm512_castps_si512(v1)));
}

/* v[0, P): 16 rows of P 32-bit words, row-major (row i's word q at word i * P + q of the P vectors) ->
 * v[q] = word q of rows 0..15, for P a power of two <= 32: log2(P) unzips (each moves the lowest bit
 * of a word's index to the top: even words of a vector pair first, then odd ones) rotate the index
 * (row, q) into (q, row) */
static inline __attribute__((always_inline)) void transpose_rows16_p(__m512i *v, const int P) {
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    __m512i t[32];
    for (int s = 1; s < P; s *= 2) {
        for (int k = 0; k < P / 2; k++) {
            t[k] = _mm512_permutex2var_epi32(v[2 * k], even, v[2 * k + 1]);
            t[P / 2 + k] = _mm512_permutex2var_epi32(v[2 * k], odd, v[2 * k + 1]);
        }
        for (int k = 0; k < P; k++) v[k] = t[k];
    }
}

/* 16 rows' P pairs from `tile` (rows at stride P words) -> P lines of 16 pairs, streamed to d + q * stride
 * (P a constant: the vectors stay in registers) */
static inline __attribute__((always_inline)) void transpose_store(const uint32_t *tile, const int P, uint16_t *d,
                                                                  int64_t stride) {
    __m512i v[32];
    for (int q = 0; q < P; q++) v[q] = _mm512_loadu_si512(tile + 16 * q);
    transpose_rows16_p(v, P);
    for (int q = 0; q < P; q++) _mm512_stream_si512((__m512i *)(d + q * stride), v[q]);
}

/* kind 2 from any source dtype, r even and <= 64, out a multiple of 16, a finite scale: JB rows of B (all r
 * ranks: one contiguous run) converted 32 values at a time into a tile, whose adjacent rank pairs are 32-bit
 * words; the tile's pair rows are then streamed (out * 4 bytes per pair row, 64-aligned): 16 rows at a time
 * transposed in registers where r / 2 is a power of two, else gathered */
static int b_stream_bf16(const uint8_t *restrict src, const pack_piece *p, uint16_t *restrict out, uint32_t *bad) {
    const int64_t n_out = p->rows, r = p->cols, P = r / 2, item = p->src_dtype == 0 ? 4 : 2;
    uint16_t *first = out + p->dst;
    union { float f; uint32_t u; } sc = {p->scale};
    if (p->kind != 2 || r % 2 || r > 64 || n_out % 16 || ((uintptr_t)first | (uintptr_t)(n_out * 4)) % 64 ||
        (sc.u & 0x7f800000u) == 0x7f800000u) return 0;
    const __m512 scale = _mm512_set1_ps(p->scale);
    uint32_t tile[JB * 32];
    __mmask16 b = 0;
    const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32((int)P));
    for (int64_t j0 = 0; j0 < n_out; j0 += JB) {
        const int64_t nj = j0 + JB < n_out ? JB : n_out - j0, n = nj * r;   /* n: a multiple of 32 */
        const uint8_t *s = src + j0 * r * item;
        uint16_t *t16 = (uint16_t *)tile;
        for (int64_t t = 0; t < n; t += 32) {   /* bf16(bf16(B) * scale), as the scalar path */
            _mm_prefetch((const char *)(s + (t + PF_AHEAD) * item), _MM_HINT_T0);
            _mm_prefetch((const char *)(s + (t + PF_AHEAD + 16) * item), _MM_HINT_T0);
            _mm512_storeu_si512(t16 + t, scaled32_bf16(load16_bits(s, p->src_dtype, t),
                                                       load16_bits(s, p->src_dtype, t + 16), scale, &b));
        }
        if (!(P & (P - 1))) {
            for (int64_t j = 0; j < nj; j += 16) {
                const uint32_t *tj = tile + j * P;
                uint16_t *d = first + 2 * (j0 + j);
                switch (P) {
                case 1: transpose_store(tj, 1, d, 2 * n_out); break;
                case 2: transpose_store(tj, 2, d, 2 * n_out); break;
                case 4: transpose_store(tj, 4, d, 2 * n_out); break;
                case 8: transpose_store(tj, 8, d, 2 * n_out); break;
                case 16: transpose_store(tj, 16, d, 2 * n_out); break;
                default: transpose_store(tj, 32, d, 2 * n_out); break;
                }
            }
            continue;
        }
        for (int64_t q = 0; q < P; q++) {
            uint16_t *d = first + q * 2 * n_out + 2 * j0;
            for (int64_t j = 0; j < nj; j += 16)
                _mm512_stream_si512((__m512i *)(d + 2 * j),
                                    _mm512_i32gather_epi32(idx, (const int *)(tile + j * P + q), 4));
        }
    }
    *bad = b != 0;
    return 1;
}
#endif

#ifdef __AVX2__
/* kind 1 (B transposed, plain) into bf16 from fp32 or bf16 with AVX2: 16 rows x 8 ranks at a time, two 8x8
 * transposes in registers, each rank's 16 values one 32-byte store. f32_to_bf16's rounding, 8 at a time (the
 * same bits as the scalar path, which was ~7 cycles a value: most of a cold load on AVX2-only CPUs). */
static inline __m256i cvt8_bf16(__m256i u, __m256i *bad) {       /* 8 lanes: bf16 bits in each low half */
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    const __m256i h = _mm256_blendv_epi8(rounded, quiet, nan);
    *bad = _mm256_or_si256(*bad, _mm256_cmpeq_epi32(_mm256_and_si256(h, _mm256_set1_epi32(0x7f80)),
                                                    _mm256_set1_epi32(0x7f80)));
    return h;
}

/* 8 source values at element i as fp32 bits (bf16: widened, exact) */
static inline __m256i load8_bits(const uint8_t *src, int bf16_src, int64_t i) {
    if (bf16_src)
        return _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + 2 * i))), 16);
    return _mm256_loadu_si256((const __m256i *)(src + 4 * i));
}

/* r[c] <- column c of the 8x8 block of 32-bit lanes */
static inline void transpose8(__m256i *r) {
    __m256 t[8], q[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(_mm256_castsi256_ps(r[i]), _mm256_castsi256_ps(r[i + 1]));
        t[i + 1] = _mm256_unpackhi_ps(_mm256_castsi256_ps(r[i]), _mm256_castsi256_ps(r[i + 1]));
    }
    for (int i = 0; i < 8; i += 4) {
        q[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        q[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        q[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        q[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_castps_si256(_mm256_permute2f128_ps(q[i], q[i + 4], 0x20));
        r[i + 4] = _mm256_castps_si256(_mm256_permute2f128_ps(q[i], q[i + 4], 0x31));
    }
}

/* bf16(bf16(x) * scale) of 8 lanes (x's own check into bad) */
static inline __m256i scaled8(__m256i x, __m256 scale, __m256i *bad, __m256i *unused) {
    const __m256i h = cvt8_bf16(x, bad);
    return cvt8_bf16(_mm256_castps_si256(_mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(h, 16)), scale)), unused);
}

/* 16 bf16 (two 8-lane halves, low 16 bits each) in order -> 32 bytes */
static inline __m256i pack16(__m256i lo, __m256i hi) {
    return _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8);
}

/* B: JB2 rows x 8 ranks a step; with the rank rows 64-byte aligned (out a multiple of 32), each rank's 32
 * values are one whole line written around the caches (non-temporal: the pages are next read by a step,
 * from memory anyway; no destination line is read first), else 16 rows a step with plain stores */
static int bf16_b_avx2(const uint8_t *restrict src, const pack_piece *p, uint16_t *restrict out, uint32_t *bad) {
    const int64_t n_out = p->rows, r = p->cols;
    if (p->kind != 1 || p->src_dtype > 1 || r % 8 || n_out % 16) return 0;
    const int bf16_src = p->src_dtype == 1;
    const int stream = n_out % 32 == 0 && (uintptr_t)(out + p->dst) % 64 == 0;
    const int64_t rows = stream ? 32 : 16;
    const __m256 scale = _mm256_set1_ps(p->scale);
    __m256i b = _mm256_setzero_si256(), unused = _mm256_setzero_si256();
    for (int64_t j0 = 0; j0 < n_out; j0 += rows) {
        for (int64_t k0 = 0; k0 < r; k0 += 8) {
            __m256i t[4][8];                          /* rows j0 + 8q .. j0 + 8q + 7, ranks k0 .. k0 + 7 */
            for (int q = 0; q < rows / 8; q++) {
                for (int i = 0; i < 8; i++)
                    t[q][i] = scaled8(load8_bits(src, bf16_src, (j0 + 8 * q + i) * r + k0), scale, &b, &unused);
                transpose8(t[q]);
            }
            for (int c = 0; c < 8; c++) {              /* rank k0 + c: its values, in order */
                uint16_t *d = out + p->dst + (k0 + c) * n_out + j0;
                if (stream) {
                    _mm256_stream_si256((__m256i *)d, pack16(t[0][c], t[1][c]));
                    _mm256_stream_si256((__m256i *)(d + 16), pack16(t[2][c], t[3][c]));
                } else {
                    _mm256_storeu_si256((__m256i *)d, pack16(t[0][c], t[1][c]));
                }
            }
        }
    }
    *bad = !_mm256_testz_si256(b, b);
    return 1;
}

/* kind 0 (A's rows) into bf16 from fp32 or bf16, each row's start 64-byte aligned and cols a multiple of
 * 32: 32 values a line, written around the caches */
static int bf16_a_avx2(const uint8_t *restrict src, const pack_piece *p, uint16_t *restrict out, uint32_t *bad) {
    if (p->kind != 0 || p->src_dtype > 1 || p->cols % 32 || (uintptr_t)(out + p->dst) % 64 ||
        (uintptr_t)(out + p->dst + (int64_t)p->g * p->cols) % 64 || (p->G * p->cols) % 32) return 0;
    const int bf16_src = p->src_dtype == 1;
    __m256i b = _mm256_setzero_si256();
    for (int64_t k = 0; k < p->rows; k++) {
        uint16_t *d = out + p->dst + (k * p->G + p->g) * p->cols;
        const int64_t s = k * p->cols;
        for (int64_t j = 0; j < p->cols; j += 32) {
            const __m256i h0 = cvt8_bf16(load8_bits(src, bf16_src, s + j), &b);
            const __m256i h1 = cvt8_bf16(load8_bits(src, bf16_src, s + j + 8), &b);
            const __m256i h2 = cvt8_bf16(load8_bits(src, bf16_src, s + j + 16), &b);
            const __m256i h3 = cvt8_bf16(load8_bits(src, bf16_src, s + j + 24), &b);
            _mm256_stream_si256((__m256i *)(d + j), pack16(h0, h1));
            _mm256_stream_si256((__m256i *)(d + j + 16), pack16(h2, h3));
        }
    }
    *bad = !_mm256_testz_si256(b, b);
    return 1;
}
#endif

static uint32_t pack_piece_bf16(const uint8_t *src, const pack_piece *p, void *out) {
    uint16_t *o = (uint16_t *)out;
#ifdef __AVX512BW__
    uint32_t bad = 0;
    if (p->src_dtype == 0 && p->kind == 0 && f32_bf16_run_stream((const float *)src, p, o, &bad)) return bad;
    if (p->kind == 0 && a_stream_bf16(src, p, o, &bad)) return bad;
    if (p->kind == 2 && b_stream_bf16(src, p, o, &bad)) return bad;
#endif
#ifdef __AVX2__
    uint32_t bad2 = 0;
    if (p->kind == 1 && bf16_b_avx2(src, p, o, &bad2)) return bad2;
    if (p->kind == 0 && bf16_a_avx2(src, p, o, &bad2)) return bad2;
#endif
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
        if (bad) {
#if defined(__AVX512BW__) || defined(__AVX2__)
            _mm_sfence();
#endif
            return -(1 + i);
        }
    }
#if defined(__AVX512BW__) || defined(__AVX2__)
    _mm_sfence();           /* the streamed lines are written before the caller hands the pages on */
#endif
    return 0;
}
