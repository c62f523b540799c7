/* bf16 LoRA building blocks on AVX512-BF16, shared by lora.c and gemm_lora_avx512bf16.c.
 * shrink_bf16: v[row] = A[row] . x (vdpbf16ps: exact bf16 products, fp32 sums), 16 rows per pass over x.
 * expand_pairs_bf16: y[0, o) += sum_k v[k] * Bt[k] with one rounding per output, on vdpbf16ps over the paired
 * B layout (two ranks per instruction).
 * A token's delta is computed in one order whatever kernel runs it (decode, segment, or a GEMM epilogue):
 * each shrink row one chain then sum16; each expand column two chains from zero (even and odd rank
 * pairs), added, then added to the bf16 y and rounded. So a token's output never depends on whether it
 * ran as a decode token or in a prefill segment, i.e. on how the scheduler chunked its prompt. */
#pragma once
#include <immintrin.h>
#include <stdint.h>

#include "sum16.h"

static inline __mmask32 mask32(int64_t left) { return left >= 32 ? 0xffffffffu : (__mmask32)((1ull << left) - 1); }

/* v[0, 16) = A[0, 16) . x: 16 independent dot products (16 vdpbf16ps chains per x load hide its
 * latency), reduced together by sum16's transpose-add tree. Every row's sum is one chain over x's
 * 32-element chunks from zero, then sum16's order: the segment kernel (lora.c's shrink_tile_bf16)
 * computes each (token, row) the same way, so a token gets the same bits whichever kernel runs it. */
static inline void shrink16_bf16(const uint16_t *xt, const uint16_t *as, int in, float *v) {
    __m512 d[16];
    for (int q = 0; q < 16; q++) d[q] = _mm512_setzero_ps();
    for (int j = 0; j < in; j += 32) {
        const __mmask32 m = mask32(in - j);
        const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, xt + j);
        for (int q = 0; q < 16; q++)
            d[q] = _mm512_dpbf16_ps(d[q], (__m512bh)_mm512_maskz_loadu_epi16(m, as + q * (int64_t)in + j), xv);
    }
    _mm512_storeu_ps(v, sum16(d));
}

/* v[0, rows) = A[0, rows) . x, 16 rows at a time, the last rows one chain each, reduced by the same tree
 * (lane 0 of sum16 over the chain and zeros: sum16 sums every vector in the same order). */
static inline void shrink_bf16(const uint16_t *xt, const uint16_t *as, int rows, int in, float *v) {
    int row = 0;
    for (; row + 16 <= rows; row += 16) shrink16_bf16(xt, as + (int64_t)row * in, in, v + row);
    for (; row < rows; row++) {
        const uint16_t *ar = as + (int64_t)row * in;
        __m512 d[16];
        for (int q = 0; q < 16; q++) d[q] = _mm512_setzero_ps();
        for (int j = 0; j < in; j += 32) {
            const __mmask32 m = mask32(in - j);
            d[0] = _mm512_dpbf16_ps(d[0], (__m512bh)_mm512_maskz_loadu_epi16(m, ar + j),
                                    (__m512bh)_mm512_maskz_loadu_epi16(m, xt + j));
        }
        float sums[16];
        _mm512_storeu_ps(sums, sum16(d));
        v[row] = sums[0];
    }
}

/* The paired B layout of the bf16 kernels: Bt [ceil(R / 2)][out][2], element (k, c) at (k / 2, c, k % 2), so
 * that one 64-byte load holds 16 columns x 2 consecutive ranks: vdpbf16ps's operand, like the packed base
 * weights. The odd rank past an odd r is zero. v is paired the same way: vp[kk * G + g] holds ranks 2kk and
 * 2kk + 1 of output g as two bf16 in one int32 (the intermediate rounded to bf16, as a bf16 LoRA does). */
static inline uint32_t bf16_pair(float lo, float hi) {
    const __m128bh h = _mm_cvtneps_pbh(_mm_setr_ps(lo, hi, 0.f, 0.f));
    return (uint32_t)_mm_cvtsi128_si32((__m128i)h);
}

/* vp[kk * G + g] = (v[2kk * G + g], v[(2kk + 1) * G + g]) for kk < ceil(r / 2), the rank past r as 0 */
static inline void pair_v(const float *v, int r, int G, uint32_t *vp) {
    for (int k = 0; k < r; k += 2)
        for (int g = 0; g < G; g++) vp[k / 2 * G + g] = bf16_pair(v[k * G + g], k + 1 < r ? v[(k + 1) * G + g] : 0.f);
}

static inline __mmask16 mask16(int64_t left) {
    return left <= 0 ? 0 : left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
}

static inline __mmask32 pair_mask(int64_t cols) { return cols <= 0 ? 0 : mask32(2 * cols); }

/* y[0, o) += sum_k v_k * Bt[k] (bs: paired, columns at pair-row stride 2 * stride; vp: pairs at step G),
 * one rounding per output: each 32-column chunk's sums stay in registers over all rank pairs. */
static inline void expand_pairs_bf16(const uint16_t *bs, int64_t o, int64_t stride, int r, const uint32_t *vp, int G,
                                     uint16_t *yt) {
    const int P = (r + 1) / 2;
    for (int64_t j = 0; j < o; j += 32) {
        const __mmask32 m0 = pair_mask(o - j), m1 = pair_mask(o - j - 16);
        __m512 e0 = _mm512_setzero_ps(), e1 = e0, d0 = e0, d1 = e0;
        const uint16_t *bp = bs + 2 * j;
        int kk = 0;
        for (; kk + 2 <= P; kk += 2, bp += 4 * stride) {       /* two chains per half: half the latency */
            const __m512bh v0 = (__m512bh)_mm512_set1_epi32((int)vp[kk * G]), v1 = (__m512bh)_mm512_set1_epi32((int)vp[(kk + 1) * G]);
            e0 = _mm512_dpbf16_ps(e0, (__m512bh)_mm512_maskz_loadu_epi16(m0, bp), v0);
            d0 = _mm512_dpbf16_ps(d0, (__m512bh)_mm512_maskz_loadu_epi16(m1, bp + 32), v0);
            e1 = _mm512_dpbf16_ps(e1, (__m512bh)_mm512_maskz_loadu_epi16(m0, bp + 2 * stride), v1);
            d1 = _mm512_dpbf16_ps(d1, (__m512bh)_mm512_maskz_loadu_epi16(m1, bp + 2 * stride + 32), v1);
        }
        if (kk < P) {
            const __m512bh v0 = (__m512bh)_mm512_set1_epi32((int)vp[kk * G]);
            e0 = _mm512_dpbf16_ps(e0, (__m512bh)_mm512_maskz_loadu_epi16(m0, bp), v0);
            d0 = _mm512_dpbf16_ps(d0, (__m512bh)_mm512_maskz_loadu_epi16(m1, bp + 32), v0);
        }
        const __mmask16 y0 = mask16(o - j), y1 = mask16(o - j - 16);
        const __m512 a0 = _mm512_cvtpbh_ps((__m256bh)_mm256_maskz_loadu_epi16(y0, yt + j));
        const __m512 a1 = _mm512_cvtpbh_ps((__m256bh)_mm256_maskz_loadu_epi16(y1, yt + j + 16));
        _mm256_mask_storeu_epi16(yt + j, y0, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(a0, _mm512_add_ps(e0, e1))));
        if (y1) _mm256_mask_storeu_epi16(yt + j + 16, y1, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(a1, _mm512_add_ps(d0, d1))));
    }
}

/* Rows of one adapter (the same A, B and rank) computed together, each weight load serving all of them: the
 * GEMM's decode rows of an adapter several requests share. Every row gets exactly the bits shrink_bf16 and
 * expand_pairs_bf16 give it alone (the same chains in the same order; sum16 sums every vector alike). */
#define GROUP_ROWS 4

/* v[t][row] = A[row] . x_t for t < nt (1 <= nt <= GROUP_ROWS), row < rows; 4 tokens x 4 rows per pass */
static inline void shrink_rows_bf16(const uint16_t *const *xs, int nt, const uint16_t *as, int rows, int in,
                                    float *const *v) {
    const uint16_t *xt[GROUP_ROWS];
    for (int t = 0; t < GROUP_ROWS; t++) xt[t] = xs[t < nt ? t : nt - 1];
    for (int row = 0; row < rows; row += 4) {
        const uint16_t *ar[4];
        for (int q = 0; q < 4; q++) ar[q] = as + (int64_t)(row + q < rows ? row + q : rows - 1) * in;
        __m512 d[16];
        for (int q = 0; q < 16; q++) d[q] = _mm512_setzero_ps();
        for (int j = 0; j < in; j += 32) {
            const __mmask32 m = mask32(in - j);
            __m512bh xv[GROUP_ROWS], av[4];
            for (int t = 0; t < GROUP_ROWS; t++) xv[t] = (__m512bh)_mm512_maskz_loadu_epi16(m, xt[t] + j);
            for (int q = 0; q < 4; q++) av[q] = (__m512bh)_mm512_maskz_loadu_epi16(m, ar[q] + j);
            for (int t = 0; t < GROUP_ROWS; t++)
                for (int q = 0; q < 4; q++) d[t * 4 + q] = _mm512_dpbf16_ps(d[t * 4 + q], av[q], xv[t]);
        }
        float sums[16];
        _mm512_storeu_ps(sums, sum16(d));
        for (int t = 0; t < nt; t++)
            for (int q = 0; q < 4 && row + q < rows; q++) v[t][row + q] = sums[t * 4 + q];
    }
}

/* y_t[0, o) += sum_k v_t,k * Bt[k] for t < nt: expand_pairs_bf16 for rows sharing Bt (bs, stride as there;
 * vps[t]: row t's pairs at step G), each B line loaded once for all of them (the GEMM's decode rows of one
 * adapter; the segment kernel's tokens) */
static inline void expand_rows_bf16(const uint16_t *bs, int64_t o, int64_t stride, int r, const uint32_t *const *vps,
                                    int G, uint16_t *const *ys, int nt) {
    const int P = (r + 1) / 2;
    for (int64_t j = 0; j < o; j += 32) {
        const __mmask32 m0 = pair_mask(o - j), m1 = pair_mask(o - j - 16);
        __m512 e0[GROUP_ROWS], e1[GROUP_ROWS], d0[GROUP_ROWS], d1[GROUP_ROWS];
        for (int t = 0; t < GROUP_ROWS; t++) e0[t] = e1[t] = d0[t] = d1[t] = _mm512_setzero_ps();
        const uint16_t *bp = bs + 2 * j;
        int kk = 0;
        for (; kk + 2 <= P; kk += 2, bp += 4 * stride) {
            _mm_prefetch((const char *)(bp + 4 * stride), _MM_HINT_T0);     /* two pair rows ahead */
            _mm_prefetch((const char *)(bp + 6 * stride), _MM_HINT_T0);
            const __m512bh w0 = (__m512bh)_mm512_maskz_loadu_epi16(m0, bp), w1 = (__m512bh)_mm512_maskz_loadu_epi16(m1, bp + 32);
            const __m512bh u0 = (__m512bh)_mm512_maskz_loadu_epi16(m0, bp + 2 * stride);
            const __m512bh u1 = (__m512bh)_mm512_maskz_loadu_epi16(m1, bp + 2 * stride + 32);
            for (int t = 0; t < GROUP_ROWS; t++) {
                if (t >= nt) break;
                const __m512bh v0 = (__m512bh)_mm512_set1_epi32((int)vps[t][kk * G]);
                const __m512bh v1 = (__m512bh)_mm512_set1_epi32((int)vps[t][(kk + 1) * G]);
                e0[t] = _mm512_dpbf16_ps(e0[t], w0, v0);
                d0[t] = _mm512_dpbf16_ps(d0[t], w1, v0);
                e1[t] = _mm512_dpbf16_ps(e1[t], u0, v1);
                d1[t] = _mm512_dpbf16_ps(d1[t], u1, v1);
            }
        }
        if (kk < P) {
            const __m512bh w0 = (__m512bh)_mm512_maskz_loadu_epi16(m0, bp), w1 = (__m512bh)_mm512_maskz_loadu_epi16(m1, bp + 32);
            for (int t = 0; t < GROUP_ROWS; t++) {
                if (t >= nt) break;
                const __m512bh v0 = (__m512bh)_mm512_set1_epi32((int)vps[t][kk * G]);
                e0[t] = _mm512_dpbf16_ps(e0[t], w0, v0);
                d0[t] = _mm512_dpbf16_ps(d0[t], w1, v0);
            }
        }
        const __mmask16 y0 = mask16(o - j), y1 = mask16(o - j - 16);
        for (int t = 0; t < GROUP_ROWS; t++) {
            if (t >= nt) break;
            uint16_t *yt = ys[t];
            const __m512 a0 = _mm512_cvtpbh_ps((__m256bh)_mm256_maskz_loadu_epi16(y0, yt + j));
            const __m512 a1 = _mm512_cvtpbh_ps((__m256bh)_mm256_maskz_loadu_epi16(y1, yt + j + 16));
            _mm256_mask_storeu_epi16(yt + j, y0, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(a0, _mm512_add_ps(e0[t], e1[t]))));
            if (y1) _mm256_mask_storeu_epi16(yt + j + 16, y1, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(a1, _mm512_add_ps(d0[t], d1[t]))));
        }
    }
}
