/* bf16 LoRA building blocks on AVX512-BF16, shared by lora_decode.c and gemm_lora.c.
 * shrink_bf16: v[row] = A[row] . x (vdpbf16ps: exact bf16 products, fp32 sums), 4 rows per pass over x.
 * expand_add_bf16: y[0, o) += sum_k v[k * G] * B[k] with one rounding per output (fp32 FMAs; 32 bf16 of
 * a B row split into their even and odd columns by two integer ops, no conversion instructions). */
#pragma once
#include <immintrin.h>
#include <stdint.h>

static inline void prefetch_t0(const void *p, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch((const char *)p + i, 0, 3);
}

static inline __mmask32 mask32(int64_t left) { return left >= 32 ? 0xffffffffu : (__mmask32)((1ull << left) - 1); }

static inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }

static inline void shrink_bf16(const uint16_t *xt, const uint16_t *as, int rows, int in, float *v) {
    int row = 0;
    for (; row + 4 <= rows; row += 4) {
        const uint16_t *a0 = as + (int64_t)row * in, *a1 = a0 + in, *a2 = a1 + in, *a3 = a2 + in;
        prefetch_t0(a0 + 8 * (int64_t)in, 4 * in * sizeof(uint16_t));
        __m512 d0 = _mm512_setzero_ps(), d1 = d0, d2 = d0, d3 = d0;
        for (int j = 0; j < in; j += 32) {
            const __mmask32 m = mask32(in - j);
            const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, xt + j);
            d0 = _mm512_dpbf16_ps(d0, (__m512bh)_mm512_maskz_loadu_epi16(m, a0 + j), xv);
            d1 = _mm512_dpbf16_ps(d1, (__m512bh)_mm512_maskz_loadu_epi16(m, a1 + j), xv);
            d2 = _mm512_dpbf16_ps(d2, (__m512bh)_mm512_maskz_loadu_epi16(m, a2 + j), xv);
            d3 = _mm512_dpbf16_ps(d3, (__m512bh)_mm512_maskz_loadu_epi16(m, a3 + j), xv);
        }
        v[row] = hsum(d0); v[row + 1] = hsum(d1); v[row + 2] = hsum(d2); v[row + 3] = hsum(d3);
    }
    for (; row < rows; row++) {
        const uint16_t *ar = as + (int64_t)row * in;
        __m512 d = _mm512_setzero_ps();
        for (int j = 0; j < in; j += 32) {
            const __mmask32 m = mask32(in - j);
            d = _mm512_dpbf16_ps(d, (__m512bh)_mm512_maskz_loadu_epi16(m, ar + j),
                                 (__m512bh)_mm512_maskz_loadu_epi16(m, xt + j));
        }
        v[row] = hsum(d);
    }
}

/* y[0, o) += sum_k v[k * G] * B[k] (B: r rows of o columns at `stride`), one rounding per output. Column chunks
 * outermost: a chunk's 32 sums stay in registers over all ranks (even and odd columns apart), so the
 * only memory traffic is B itself and one read-modify-write of y. */
static inline void expand_add_bf16(const uint16_t *bs, int64_t o, int64_t stride, int r, const float *v, int G, uint16_t *yt) {
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
    for (int64_t j = 0; j < o; j += 32) {
        const __mmask32 m = mask32(o - j);
        __m512 e0 = _mm512_setzero_ps(), d0 = e0, e1 = e0, d1 = e0;
        const uint16_t *bp = bs + j;
        int k = 0;
        for (; k + 2 <= r; k += 2, bp += 2 * stride) {
            _mm_prefetch((const char *)(bp + 128), _MM_HINT_T0);       /* 4 chunks ahead in both rows */
            _mm_prefetch((const char *)(bp + stride + 128), _MM_HINT_T0);
            const __m512i w0 = _mm512_maskz_loadu_epi16(m, bp), w1 = _mm512_maskz_loadu_epi16(m, bp + stride);
            const __m512 v0 = _mm512_set1_ps(v[k * G]), v1 = _mm512_set1_ps(v[(k + 1) * G]);
            e0 = _mm512_fmadd_ps(v0, _mm512_castsi512_ps(_mm512_slli_epi32(w0, 16)), e0);
            d0 = _mm512_fmadd_ps(v0, _mm512_castsi512_ps(_mm512_and_si512(w0, hi)), d0);
            e1 = _mm512_fmadd_ps(v1, _mm512_castsi512_ps(_mm512_slli_epi32(w1, 16)), e1);
            d1 = _mm512_fmadd_ps(v1, _mm512_castsi512_ps(_mm512_and_si512(w1, hi)), d1);
        }
        if (k < r) {
            const __m512i w0 = _mm512_maskz_loadu_epi16(m, bp);
            const __m512 v0 = _mm512_set1_ps(v[k * G]);
            e0 = _mm512_fmadd_ps(v0, _mm512_castsi512_ps(_mm512_slli_epi32(w0, 16)), e0);
            d0 = _mm512_fmadd_ps(v0, _mm512_castsi512_ps(_mm512_and_si512(w0, hi)), d0);
        }
        const __m512i yv = _mm512_maskz_loadu_epi16(m, yt + j);
        const __m512 e = _mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(yv, 16)), _mm512_add_ps(e0, e1));
        const __m512 d = _mm512_add_ps(_mm512_castsi512_ps(_mm512_and_si512(yv, hi)), _mm512_add_ps(d0, d1));
        const __m512i lo16 = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(e));
        const __m512i hi16 = _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(d)), 16);
        _mm512_mask_storeu_epi16(yt + j, m, _mm512_or_si512(lo16, hi16));
    }
}

