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

#if defined(__AVX512BF16__)
#include <immintrin.h>
/* bf16 dot product of length d (a multiple of 32) with vdpbf16ps: no conversion, fp32 accumulation */
static inline float dot_bf16(const uint16_t *a, const uint16_t *b, int d) {
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < d; i += 32)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(a + i), (__m512bh)_mm512_loadu_si512(b + i));
    return _mm512_reduce_add_ps(acc);
}
#define FAST_DOT_BF16 1
#else
static inline float dot_bf16(const uint16_t *a, const uint16_t *b, int d) { (void)a; (void)b; (void)d; return 0.f; }
#define FAST_DOT_BF16 0
#endif
static inline float dot_f32_unused(const float *a, const float *b, int d) { (void)a; (void)b; (void)d; return 0.f; }

static inline void prefetch_block(const char *p, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i, 0, 1);
}

#define MAX_HEADS 128
#define MAX_DIM 256
#define MAX_ROW (MAX_HEADS * MAX_DIM)

#define DEFINE_DECODE(NAME, T, LOAD, STORE, FAST, FAST_DOT)                                                                  \
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
            if (FAST && d % 32 == 0) {                                                                        \
                for (int64_t t = 0; t < n; t++)                                                               \
                    for (int j = 0; j < H; j++) {                                                             \
                        const float dot = FAST_DOT(q + ((int64_t)s * H + j) * d, kb + t * row + (j / G) * d, d) * scale; \
                        score[j * len + b * bs + t] = dot;                                                    \
                        if (dot > mx[j]) mx[j] = dot;                                                         \
                    }                                                                                         \
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
        for (int j = 0; j < H; j++) {                                                                         \
            const float inv = 1.f / sum[j];                                                                   \
            for (int i = 0; i < d; i++) out[((int64_t)s * H + j) * d + i] = STORE(acc[j * d + i] * inv);    \
        }                                                                                                     \
        free(qf);                                                                                             \
    }                                                                                                         \
    return failed ? -2 : 0;                                                                                   \
}

DEFINE_DECODE(paged_decode_attention_bf16, uint16_t, bf16_to_f32, f32_to_bf16, FAST_DOT_BF16, dot_bf16)
DEFINE_DECODE(paged_decode_attention_f32, float, f32_id, f32_id, 0, dot_f32_unused)
