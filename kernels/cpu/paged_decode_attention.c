/* Paged decode attention for CPU: one query token per sequence, K/V read in place through the block table.
 *
 * q, out:   [D, H, d]                          (bf16 or fp32, contiguous)
 * k, v:     page p holds a block [bs, KVH, d] (contiguous) at k + p * page_stride (v likewise)
 * tables:   [D, max_blocks] int64 page ids;    lens: [D] int64 context lengths (>= 1)
 * One task per sequence: every block is read front to back once for all heads (query head j uses KV head
 * j / (H / KVH)), and the next block is prefetched while the current one is computed. Softmax and
 * accumulation are in fp32; bf16 output is rounded to nearest even. Parallel over sequences with OpenMP
 * (torch's own runtime when loaded into a torch process).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "sum16.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#define FAST_DOT_BF16 1


/* scores of query q (d bf16, d a multiple of 32) against n <= 16 keys at rows k + t * row_stride:
 * out[t] = scale * q . k_t; *mx = max(*mx, out[0..n)) */
static inline void scores16_bf16(const uint16_t *q, const uint16_t *k, int64_t row_stride, int n, int d,
                                 float scale, float *out, float *mx) {
    __m512 acc[16];
    const uint16_t *kt[16];
    for (int t = 0; t < 16; t++) {
        acc[t] = _mm512_setzero_ps();
        kt[t] = k + (t < n ? t : 0) * row_stride;     /* rows past n repeat row 0; masked out below */
    }
    for (int i = 0; i < d; i += 32) {
        const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + i);
        for (int t = 0; t < 16; t++)
            acc[t] = _mm512_dpbf16_ps(acc[t], (__m512bh)_mm512_loadu_si512(kt[t] + i), qv);
    }
    const __mmask16 m = n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1);
    const __m512 sc = _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale));
    _mm512_mask_storeu_ps(out, m, sc);
    const float best = _mm512_mask_reduce_max_ps(m, sc);
    if (best > *mx) *mx = best;
}

static inline __m512 load_bf16x16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* head_dim 64, at most 4 query heads per KV head: acc[g, :] += sum_t p[g, t] * v[t, :] over n tokens of
 * one block, the G x 64 accumulators kept in registers. p: G rows at p_stride; v rows at v_stride.
 * Two tokens per vdpbf16ps: p is rounded to bf16 (as flash attention does for its P @ V product) and
 * paired (p[t], p[t+1]); the two V rows are interleaved by 16-bit unpacks, which leaves the accumulator's
 * dims in the order of `unpermute_d64` (applied once per sequence, after the last block). */
static inline void pv_bf16_d64(float *acc, const float *p, int64_t p_stride, const uint16_t *v, int64_t v_stride,
                               int n, int G) {
    __m512 a[4][4];
    for (int g = 0; g < 4; g++)
        for (int c = 0; c < 4; c++) a[g][c] = g < G ? _mm512_loadu_ps(acc + g * 64 + c * 16) : _mm512_setzero_ps();
    for (int t0 = 0; t0 < n; t0 += 16) {
        const int m = n - t0 < 16 ? n - t0 : 16;
        uint32_t pairs[4][8];
        for (int g = 0; g < G; g++)   /* 16 probabilities -> 8 (p[t], p[t+1]) bf16 pairs, zero past n */
            _mm256_storeu_si256((__m256i *)pairs[g], (__m256i)_mm512_cvtneps_pbh(
                _mm512_maskz_loadu_ps((__mmask16)((1u << m) - 1), p + g * p_stride + t0)));
        for (int t = 0; t < m; t += 2) {
            const uint16_t *r0 = v + (int64_t)(t0 + t) * v_stride;
            const __m512i x0 = _mm512_loadu_si512(r0), x1 = _mm512_loadu_si512(r0 + 32);
            __m512i y0 = _mm512_setzero_si512(), y1 = y0;
            if (t + 1 < m) { y0 = _mm512_loadu_si512(r0 + v_stride); y1 = _mm512_loadu_si512(r0 + v_stride + 32); }
            const __m512bh w0 = (__m512bh)_mm512_unpacklo_epi16(x0, y0), w1 = (__m512bh)_mm512_unpackhi_epi16(x0, y0),
                           w2 = (__m512bh)_mm512_unpacklo_epi16(x1, y1), w3 = (__m512bh)_mm512_unpackhi_epi16(x1, y1);
            for (int g = 0; g < 4; g++) {
                if (g >= G) break;
                const __m512bh pg = (__m512bh)_mm512_set1_epi32((int)pairs[g][t / 2]);
                a[g][0] = _mm512_dpbf16_ps(a[g][0], w0, pg);
                a[g][1] = _mm512_dpbf16_ps(a[g][1], w1, pg);
                a[g][2] = _mm512_dpbf16_ps(a[g][2], w2, pg);
                a[g][3] = _mm512_dpbf16_ps(a[g][3], w3, pg);
            }
        }
    }
    for (int g = 0; g < G; g++)
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(acc + g * 64 + c * 16, a[g][c]);
}

/* the accumulator order of pv_bf16_d64 back to dims 0..63: vector c lane l holds dim
 * 32 * (c / 2) + 8 * (l / 4) + 4 * (c % 2) + l % 4 */
static inline void unpermute_d64(float *acc) {
    float tmp[64];
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 16; l++) tmp[32 * (c / 2) + 8 * (l / 4) + 4 * (c % 2) + l % 4] = acc[c * 16 + l];
    for (int i = 0; i < 64; i++) acc[i] = tmp[i];
}
#else
static inline void scores16_bf16(const uint16_t *q, const uint16_t *k, int64_t rs, int n, int d, float scale,
                                 float *out, float *mx) {
    (void)q; (void)k; (void)rs; (void)n; (void)d; (void)scale; (void)out; (void)mx;
}
static inline void pv_bf16_d64(float *acc, const float *p, int64_t ps, const uint16_t *v, int64_t vs, int n, int G) {
    (void)acc; (void)p; (void)ps; (void)v; (void)vs; (void)n; (void)G;
}
static inline void unpermute_d64(float *acc) { (void)acc; }
#define FAST_DOT_BF16 0
#endif
static inline void scores_f32_unused(const float *q, const float *k, int64_t rs, int n, int d, float scale,
                                     float *out, float *mx) {
    (void)q; (void)k; (void)rs; (void)n; (void)d; (void)scale; (void)out; (void)mx;
}
static inline void pv_f32_unused(float *acc, const float *p, int64_t ps, const float *v, int64_t vs, int n, int G) {
    (void)acc; (void)p; (void)ps; (void)v; (void)vs; (void)n; (void)G;
}

static inline void prefetch_block(const char *p, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i, 0, 1);
}

#define MAX_HEADS 128
#define MAX_DIM 256
#define MAX_ROW (MAX_HEADS * MAX_DIM)

#define DEFINE_DECODE(NAME, T, LOAD, STORE, FAST, FAST_SCORES, FAST_PV)                                                                  \
int NAME(const T *q, T *out, const T *k, const T *v, int64_t page_stride, const int64_t *tables,               \
         int64_t max_blocks, const int64_t *lens, int D, int H, int KVH, int d, int bs, float scale) {         \
    const int G = H / KVH, row = KVH * d;                                                                    \
    const int64_t block_bytes = (int64_t)bs * row * sizeof(T);                                               \
    if (H > MAX_HEADS || d > MAX_DIM || G * KVH != H) return -1;                                             \
    int failed = 0;                                                                                           \
    _Pragma("omp parallel for schedule(dynamic, 1)")                                                          \
    for (int s = 0; s < D; s++) {                                                                             \
        const int64_t len = lens[s], nblocks = (len + bs - 1) / bs;                                           \
        const int64_t *table = tables + (int64_t)s * max_blocks;                                             \
        float *qf = (float *)malloc(sizeof(float) * (2 * H * d + H * len + 2 * H));                           \
        if (!qf) { failed = 1; continue; }                                                                    \
        float *acc = qf + H * d, *score = acc + H * d, *mx = score + H * len, *sum = mx + H;                  \
        for (int j = 0; j < H * d; j++) { qf[j] = LOAD(q[(int64_t)s * H * d + j]) * scale; acc[j] = 0.f; }   \
        for (int j = 0; j < H; j++) { mx[j] = -FLT_MAX; sum[j] = 0.f; }                                      \
        for (int64_t b = 0; b < nblocks; b++) {                                                               \
            const T *kb = k + table[b] * page_stride;                                                         \
            if (b + 1 < nblocks) prefetch_block((const char *)(k + table[b + 1] * page_stride), block_bytes); \
            else prefetch_block((const char *)(v + table[0] * page_stride), block_bytes);                     \
            const int64_t n = (b == nblocks - 1) ? len - b * bs : bs;                                        \
            if (FAST && d % 32 == 0) {   /* 16 keys at a time per query head */                              \
                for (int64_t t0 = 0; t0 < n; t0 += 16)                                                        \
                    for (int j = 0; j < H; j++)                                                               \
                        FAST_SCORES(q + ((int64_t)s * H + j) * d, kb + t0 * row + (j / G) * d, row,           \
                                    (int)(n - t0 < 16 ? n - t0 : 16), d, scale, score + j * len + b * bs + t0, mx + j); \
                continue;                                                                                     \
            }                                                                                                 \
            for (int64_t t = 0; t < n; t++) {                                                                 \
                float kf[MAX_ROW];                                                                            \
                for (int i = 0; i < row; i++) kf[i] = LOAD(kb[t * row + i]);                                  \
                for (int j = 0; j < H; j++) {                                                                 \
                    const float *kh = kf + (j / G) * d, *qh = qf + j * d;                                     \
                    float dot = 0.f;                                                                          \
                    _Pragma("omp simd reduction(+:dot)")                                                      \
                    for (int i = 0; i < d; i++) dot += qh[i] * kh[i];                                         \
                    score[j * len + b * bs + t] = dot;                                                        \
                    if (dot > mx[j]) mx[j] = dot;                                                             \
                }                                                                                             \
            }                                                                                                 \
        }                                                                                                     \
        for (int j = 0; j < H; j++) {                                                                         \
            float *sj = score + j * len, m = mx[j], total = 0.f;                                              \
            for (int64_t t = 0; t < len; t++) { sj[t] = expf(sj[t] - m); total += sj[t]; }                    \
            sum[j] = total;                                                                                   \
        }                                                                                                     \
        for (int64_t b = 0; b < nblocks; b++) {                                                               \
            const T *vb = v + table[b] * page_stride;                                                         \
            if (b + 1 < nblocks) prefetch_block((const char *)(v + table[b + 1] * page_stride), block_bytes); \
            const int64_t n = (b == nblocks - 1) ? len - b * bs : bs;                                        \
            if (FAST && d == 64 && G <= 4) {                                                                  \
                for (int h = 0; h < KVH; h++)                                                                 \
                    FAST_PV(acc + h * G * d, score + (int64_t)h * G * len + b * bs, len, vb + h * d, row, (int)n, G); \
                continue;                                                                                     \
            }                                                                                                 \
            for (int64_t t = 0; t < n; t++) {                                                                 \
                float vf[MAX_ROW];                                                                            \
                for (int i = 0; i < row; i++) vf[i] = LOAD(vb[t * row + i]);                                  \
                for (int j = 0; j < H; j++) {                                                                 \
                    const float p = score[j * len + b * bs + t], *vh = vf + (j / G) * d;                      \
                    float *aj = acc + j * d;                                                                  \
                    for (int i = 0; i < d; i++) aj[i] += p * vh[i];                                           \
                }                                                                                             \
            }                                                                                                 \
        }                                                                                                     \
        if (FAST && d == 64 && G <= 4)                                                                        \
            for (int j = 0; j < H; j++) unpermute_d64(acc + j * d);                                           \
        for (int j = 0; j < H; j++) {                                                                         \
            const float inv = 1.f / sum[j];                                                                   \
            for (int i = 0; i < d; i++) out[((int64_t)s * H + j) * d + i] = STORE(acc[j * d + i] * inv);    \
        }                                                                                                     \
        free(qf);                                                                                             \
    }                                                                                                         \
    return failed ? -2 : 0;                                                                                   \
}

DEFINE_DECODE(paged_decode_attention_bf16, uint16_t, bf16_to_f32, f32_to_bf16, FAST_DOT_BF16, scores16_bf16, pv_bf16_d64)
DEFINE_DECODE(paged_decode_attention_f32, float, f32_id, f32_id, 0, scores_f32_unused, pv_f32_unused)
