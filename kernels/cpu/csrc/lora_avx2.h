/* bf16 multi-LoRA building blocks on AVX2 + FMA (bf16 stored, fp32 computed) for lora.c: decode
 * tokens alone, prefill tokens in segments of one adapter.
 *
 * Weights as the LoRA slots hold them: A [R][G][in] rank-major (row k * G + g is rank k of output g) and,
 * per output g, Bt [R][out_g] (B transposed, pre-scaled); only a token's first r ranks are read.
 * Every (token, row) dot product and every (token, column) expand sum is computed in one fixed order,
 * whatever the tile it is part of, so a token's delta is the same bits alone (decode kernel) or in a
 * segment of its adapter (segment kernel):
 *   shrink: lane e of 8 fp32 partial sums takes, chunk after chunk of 16 inputs, element 2e then 2e + 1
 *           (one 32-byte load of bf16 is split into even and odd elements by a shift and a mask, exactly);
 *           the 8 lanes are then added by hsum8's fixed tree;
 *   expand: column c's sum takes rank 0, 1, ... r - 1 in order, then is added to y[c] and rounded once.
 * x enters in the "split" order that matches: per chunk of 16, its 8 even elements, then its 8 odd ones,
 * fp32, zero-padded to a multiple of 16 (split_row).
 */
#pragma once
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "walker.h"

#define CH 16                                   /* inputs (or columns) per chunk */
#define PADDED(n) (((n) + CH - 1) / CH * CH)

/* even / odd elements of 16 bf16 as 8 fp32 each (bf16 is the top half of an fp32) */
static inline __m256 even8(__m256i w) { return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)); }
static inline __m256 odd8(__m256i w) { return _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32((int)0xffff0000u))); }

static inline __m256i load16(const uint16_t *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* the first n < 16 bf16 at p, zero-padded (never reads past p + n) */
static inline __m256i load16_part(const uint16_t *p, int n) {
    uint16_t t[CH] = {0};
    memcpy(t, p, sizeof(uint16_t) * (size_t)n);
    return load16(t);
}

/* xs[0, PADDED(in)) = x[0, in) (bf16) in the split order */
static inline void split_row(const uint16_t *x, int in, float *xs) {
    for (int j = 0; j < in; j += CH) {
        const __m256i w = j + CH <= in ? load16(x + j) : load16_part(x + j, in - j);
        _mm256_storeu_ps(xs + j, even8(w));
        _mm256_storeu_ps(xs + j + 8, odd8(w));
    }
}

/* lane q = the sum of the 8 lanes of d[q], by a fixed tree: ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)) */
static inline __m256 hsum8(const __m256 *d) {
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(d[0], d[1]), _mm256_hadd_ps(d[2], d[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(d[4], d[5]), _mm256_hadd_ps(d[6], d[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* out[q] = row[q] . x for q < 8, with xs[q] the split x of row q's token (rows and tokens may repeat:
 * a tile of fewer rows repeats one); 8 independent accumulator chains */
static inline __attribute__((always_inline)) void dot8(const uint16_t *const *row, const float *const *xs, int in,
                                                       float *out, walker *pf) {
    __m256 d[8];
    for (int q = 0; q < 8; q++) d[q] = _mm256_setzero_ps();
    int j = 0;
    for (; j + CH <= in; j += CH) {
        if (pf) walker_step(pf);
        for (int q = 0; q < 8; q++) {
            const __m256i w = load16(row[q] + j);
            d[q] = _mm256_fmadd_ps(even8(w), _mm256_loadu_ps(xs[q] + j), d[q]);
            d[q] = _mm256_fmadd_ps(odd8(w), _mm256_loadu_ps(xs[q] + j + 8), d[q]);
        }
    }
    if (j < in)
        for (int q = 0; q < 8; q++) {
            const __m256i w = load16_part(row[q] + j, in - j);
            d[q] = _mm256_fmadd_ps(even8(w), _mm256_loadu_ps(xs[q] + j), d[q]);
            d[q] = _mm256_fmadd_ps(odd8(w), _mm256_loadu_ps(xs[q] + j + 8), d[q]);
        }
    _mm256_storeu_ps(out, hsum8(d));
}

/* out[t][q] = row[q] . x[t] for 4 tokens x 2 rows: the dot8 order, each A load serving all 4 tokens */
static inline void dot4x2(const uint16_t *r0, const uint16_t *r1, const float *const *xs, int in, float out[8]) {
    __m256 d[8];
    for (int q = 0; q < 8; q++) d[q] = _mm256_setzero_ps();
    for (int j = 0; j < in; j += CH) {
        const __m256i w0 = j + CH <= in ? load16(r0 + j) : load16_part(r0 + j, in - j);
        const __m256i w1 = j + CH <= in ? load16(r1 + j) : load16_part(r1 + j, in - j);
        const __m256 e0 = even8(w0), o0 = odd8(w0), e1 = even8(w1), o1 = odd8(w1);
        for (int t = 0; t < 4; t++) {
            const __m256 xe = _mm256_loadu_ps(xs[t] + j), xo = _mm256_loadu_ps(xs[t] + j + 8);
            d[2 * t] = _mm256_fmadd_ps(o0, xo, _mm256_fmadd_ps(e0, xe, d[2 * t]));
            d[2 * t + 1] = _mm256_fmadd_ps(o1, xo, _mm256_fmadd_ps(e1, xe, d[2 * t + 1]));
        }
    }
    _mm256_storeu_ps(out, hsum8(d));
}

/* v[row] = A[row] . x for row < rows (A rows of `in` bf16, contiguous; xs split) */
static inline void shrink_avx2(const float *xs, const uint16_t *a, int rows, int in, float *v, walker *pf) {
    const float *x8[8] = {xs, xs, xs, xs, xs, xs, xs, xs};
    for (int row = 0; row < rows; row += 8) {
        const uint16_t *ar[8];
        float out[8];
        for (int q = 0; q < 8; q++) ar[q] = a + (int64_t)(row + q < rows ? row + q : rows - 1) * in;
        if (pf) dot8(ar, x8, in, out, pf);
        else dot8(ar, x8, in, out, 0);
        for (int q = 0; q < 8 && row + q < rows; q++) v[row + q] = out[q];
    }
}

/* 8 fp32 -> 8 bf16, round to nearest even, NaN quieted: f32_to_bf16 of bf16.h, vectorised */
static inline __m128i to_bf16x8(__m256 f) {
    const __m256i u = _mm256_castps_si256(f);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
    const __m256i r = _mm256_blendv_epi8(rounded, quiet, nan);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

static inline __m256 from_bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* the (even, odd) sums of 16 columns interleaved back into column order: c0 = columns 0-7, c1 = 8-15 */
static inline void interleave16(__m256 ev, __m256 od, __m256 *c0, __m256 *c1) {
    const __m256 lo = _mm256_unpacklo_ps(ev, od), hi = _mm256_unpackhi_ps(ev, od);   /* [0 1 2 3|8 9 10 11], [4..7|12..15] */
    *c0 = _mm256_permute2f128_ps(lo, hi, 0x20);
    *c1 = _mm256_permute2f128_ps(lo, hi, 0x31);
}

/* y[0, n) = round(y + c[0, n)) for bf16 y, n <= 16 (c: 16 fp32 in column order) */
static inline void add_round16(uint16_t *y, __m256 c0, __m256 c1, int n) {
    uint16_t t[CH];
    uint16_t *dst = n == CH ? y : t;
    if (n < CH) memcpy(t, y, sizeof(uint16_t) * (size_t)n);
    _mm_storeu_si128((__m128i *)dst, to_bf16x8(_mm256_add_ps(from_bf16x8(dst), c0)));
    _mm_storeu_si128((__m128i *)(dst + 8), to_bf16x8(_mm256_add_ps(from_bf16x8(dst + 8), c1)));
    if (n < CH) memcpy(y, t, sizeof(uint16_t) * (size_t)n);
}

/* y[0, n) = round(y + the (even, odd) sums of 16 columns), n <= 16 */
static inline void add_store16(uint16_t *y, __m256 ev, __m256 od, int n) {
    __m256 c0, c1;
    interleave16(ev, od, &c0, &c1);
    add_round16(y, c0, c1, n);
}

/* y[t][0, NQ * 16) += sum_k v[t][k * G] * Bt[k][0..] for the nt <= TT tokens of a tile, columns of
 * full chunks (ncols: the tile's last chunk may be partial); bs: Bt at the tile's first column, rows at
 * stride o */
#define TT 4
static inline __attribute__((always_inline)) void expand_tile(const uint16_t *bs, int64_t o, int r, const float *const *v,
                                                              int G, uint16_t *const *y, int nt, int NQ, int ncols) {
    __m256 e[TT][4], d[TT][4];
    for (int t = 0; t < TT; t++)
        for (int q = 0; q < NQ; q++) e[t][q] = d[t][q] = _mm256_setzero_ps();
    const int full = ncols == NQ * CH;
    for (int k = 0; k < r; k++, bs += o) {
        __m256i w[4];
        for (int q = 0; q < NQ; q++)
            w[q] = full || (q + 1) * CH <= ncols ? load16(bs + q * CH) : load16_part(bs + q * CH, ncols - q * CH);
        for (int t = 0; t < TT; t++) {
            if (t >= nt) break;
            const __m256 vk = _mm256_broadcast_ss(v[t] + (int64_t)k * G);
            for (int q = 0; q < NQ; q++) {
                e[t][q] = _mm256_fmadd_ps(even8(w[q]), vk, e[t][q]);
                d[t][q] = _mm256_fmadd_ps(odd8(w[q]), vk, d[t][q]);
            }
        }
    }
    for (int t = 0; t < TT && t < nt; t++)
        for (int q = 0; q < NQ; q++) {
            const int n = ncols - q * CH;
            add_store16(y[t] + q * CH, e[t][q], d[t][q], n < CH ? n : CH);
        }
}

/* y[t][0, o) += sum_k v[t][k * G] * Bt[k] for t < nt (bs: Bt [r][o] of one output; v[t]: that output's
 * first intermediate, ranks at step G): 4 chunks of columns at a time for one token, 1 for several (the
 * segment kernel's expand; a decode token's is expand_rows, the same bits) */
static inline void expand_avx2(const uint16_t *bs, int64_t o, int r, const float *const *v, int G,
                               uint16_t *const *y, int nt) {
    int64_t j = 0;
    uint16_t *yj[TT];
    if (nt == 1)
        for (; j + 4 * CH <= o; j += 4 * CH) {
            yj[0] = y[0] + j;
            expand_tile(bs + j, o, r, v, G, yj, 1, 4, 4 * CH);
        }
    for (; j < o; j += CH) {     /* NOTE: a constant token count keeps the accumulators in registers */
        for (int t = 0; t < nt; t++) yj[t] = y[t] + j;
        const int n = o - j < CH ? (int)(o - j) : CH;
        if (nt == TT) expand_tile(bs + j, o, r, v, G, yj, TT, 1, n);
        else if (nt == 1) expand_tile(bs + j, o, r, v, G, yj, 1, 1, n);
        else expand_tile(bs + j, o, r, v, G, yj, nt, 1, n);
    }
}

/* y[0, n) += sum_k v[k * G] * Bt[k][0, n) for one token (bs: Bt's first column of the n, rows at stride o),
 * Bt read row after row (each row front to back: one sequential stream, which the hardware prefetchers
 * follow, where expand_tile's column tiles cross r rows at once). acc: scratch of PADDED(n) fp32, per 16
 * columns the even then the odd sums. Column c's sum still takes rank 0, 1, ... r - 1 in order from zero,
 * so the bits are expand_tile's, whatever columns a call covers. One walker step per 64 columns of a row. */
static inline void expand_rows(const uint16_t *bs, int64_t o, int64_t n, int r, const float *v, int G, uint16_t *y,
                               float *acc, walker *pf) {
    const int64_t full = n / CH * CH;
    memset(acc, 0, sizeof(float) * (size_t)PADDED(n));
    int k = 0;
    for (; k + 2 <= r; k += 2) {      /* two rows a pass: half the accumulator traffic, the same order */
        const __m256 v0 = _mm256_broadcast_ss(v + (int64_t)k * G), v1 = _mm256_broadcast_ss(v + (int64_t)(k + 1) * G);
        const uint16_t *b0 = bs + (int64_t)k * o, *b1 = b0 + o;
        for (int64_t j = 0; j < n; j += CH) {
            if (pf && (j & (4 * CH - 1)) == 0) { walker_step(pf); walker_step(pf); }
            const __m256i w0 = j < full ? load16(b0 + j) : load16_part(b0 + j, (int)(n - j));
            const __m256i w1 = j < full ? load16(b1 + j) : load16_part(b1 + j, (int)(n - j));
            __m256 e = _mm256_loadu_ps(acc + j), d = _mm256_loadu_ps(acc + j + 8);
            e = _mm256_fmadd_ps(even8(w1), v1, _mm256_fmadd_ps(even8(w0), v0, e));
            d = _mm256_fmadd_ps(odd8(w1), v1, _mm256_fmadd_ps(odd8(w0), v0, d));
            _mm256_storeu_ps(acc + j, e);
            _mm256_storeu_ps(acc + j + 8, d);
        }
    }
    for (; k < r; k++) {
        const __m256 vk = _mm256_broadcast_ss(v + (int64_t)k * G);
        const uint16_t *bk = bs + (int64_t)k * o;
        for (int64_t j = 0; j < n; j += CH) {
            if (pf && (j & (4 * CH - 1)) == 0) walker_step(pf);
            const __m256i w = j < full ? load16(bk + j) : load16_part(bk + j, (int)(n - j));
            _mm256_storeu_ps(acc + j, _mm256_fmadd_ps(even8(w), vk, _mm256_loadu_ps(acc + j)));
            _mm256_storeu_ps(acc + j + 8, _mm256_fmadd_ps(odd8(w), vk, _mm256_loadu_ps(acc + j + 8)));
        }
    }
    for (int64_t j = 0; j < n; j += CH)
        add_store16(y + j, _mm256_loadu_ps(acc + j), _mm256_loadu_ps(acc + j + 8), n - j < CH ? (int)(n - j) : CH);
}

/* the walker steps expand_rows takes for n columns at rank r */
static inline int64_t expand_steps(int64_t n, int r) { return (n + 4 * CH - 1) / (4 * CH) * r; }

/* walker steps lora_token_avx2 takes for a token of rank r */
static inline int64_t token_steps(int r, int G, int in, const int64_t *out) {
    int64_t n = (int64_t)(r * G + 7) / 8 * (in / CH);
    for (int g = 0; g < G; g++) n += expand_steps(out[g], r);
    return n;
}

/* queue the bytes of a token's adapter (A's first r * G rows, each B's first r rows) on pf, spread over
 * `steps` walker steps */
static inline void walk_token(walker *pf, const uint16_t *as, int r, int G, int in, const uint16_t *const *bg,
                              const int64_t *out, int64_t steps) {
    walker_reset(pf);
    walker_add(pf, as, (int64_t)r * G * in * 2);
    for (int g = 0; g < G; g++) walker_add(pf, bg[g], r * out[g] * 2);
    pf->per_step = (int)(walker_lines(pf) / (steps > 0 ? steps : 1)) + 1;
}

/* One token's whole delta: y[col_g + c] += sum_k (A[k, g] . x) Bt_g[k][c] for every output g, rounded once.
 * xs: the token's split x; as: its A; bg[g]: its Bt_g; v: scratch of >= r * G floats; acc: scratch of
 * PADDED(max out_g) floats; pf: NULL, or the next token's bytes to prefetch meanwhile (walk_token with
 * token_steps of this one): a decode token's adapter is read once, from memory, and its reads would
 * otherwise wait on each miss. */
static inline void lora_token_avx2(const float *xs, uint16_t *yt, const uint16_t *as, int r, int G, int in,
                                   const uint16_t *const *bg, const int64_t *out, float *v, float *acc, walker *pf) {
    shrink_avx2(xs, as, r * G, in, v, pf);
    for (int g = 0; g < G; g++) {
        expand_rows(bg[g], out[g], out[g], r, v + g, G, yt, acc, pf);
        yt += out[g];
    }
}
