/* The register tile of the bf16 GEMM (gemm_avx512bf16.c, gemm_lora_avx512bf16.c), with an optional multi-LoRA epilogue.
 *
 * Packed W (see gemm.py): [ceil(N / NB)][K / 2][NB][2], NB = 48 columns per block, columns past N zero;
 * element (n, k) sits at block n / NB, pair k / 2, lane n % NB, half k % 2, so one 64-byte load holds 16
 * columns x 2 consecutive k: exactly vdpbf16ps's operand. K must be even. A tile is MR x NB outputs (8 x 3
 * zmm accumulators) over the whole K; each output is one fp32 sum rounded once to bf16.
 */
#pragma once
#include <immintrin.h>
#include <stdint.h>

#include "amx.h"
#include "walker.h"

#define NV 3              /* zmm accumulators per row of a tile */
#define NB (16 * NV)      /* columns per block */
#define MRV 8             /* rows per register tile (vdpbf16ps) */
#if GEMM_AMX
#define MR 16             /* rows per tile: one AMX tile's rows (two register tiles where AMX is off) */
#else
#define MR MRV            /* rows per tile */
#endif
#define MC 96             /* rows per task at most: the task's x rows stay in L2 */

/* Multi-LoRA deltas added in the tile epilogue (gemm_lora_bf16): row t of the call gets
 *     y[t, c] += sum_k v_t[k, g] * Bt[g][slot[t]][k][c - start_g]   for k < rank[t]
 * for every column c of output g (outputs side by side, each a multiple of 16 columns); slot[t] < 0: none.
 * b[s * G + g] is Bt in lora_avx512bf16.h's paired layout [ceil(R / 2)][out[g]][2] (B transposed
 * and pre-scaled, as the LoRA slots); vp + t * vp_stride holds row t's v as bf16 pairs, vp[kk * G + g]. */
typedef struct {
    const int64_t *slot, *rank;
    const uint32_t *vp;
    int64_t vp_stride;
    int G;
    const uint16_t *const *b;                   /* [S][G]: b[s * G + g] */
    const int64_t *out;
} lora_args;

/* where a tile's columns [c0, c0 + 16 NV) sit in the outputs: vector j is output g[j] at column off[j] */
typedef struct { int g[NV], off[NV]; } col_map;

static inline col_map map_columns(const lora_args *l, int c0, int ncols) {
    col_map cm;
    for (int j = 0; j < NV; j++) {
        const int c = c0 + 16 * (16 * j < ncols ? j : 0);
        int g = 0, start = 0;
        while (c >= start + l->out[g]) start += (int)l->out[g++];
        cm.g[j] = g;
        cm.off[j] = c - start;
    }
    return cm;
}

/* slot s's first pair row under vector j: 16 columns x 2 ranks, one 64-byte line; pair rows 2 out[g] apart */
static inline const uint16_t *pair_base(const lora_args *l, const col_map *cm, int64_t s, int j) {
    const int g = cm->g[j];
    return l->b[s * l->G + g] + 2 * (int64_t)cm->off[j];
}

/* lora_epilogue's sums for a tile whose NV vectors are one output's consecutive columns: row acc (and, with
 * two, the next row, whose v pairs are at vp1, of the same adapter and rank) <- bf16(acc) + its delta; each
 * row's chains are the per-vector loop's, so its bits are too. */
static inline void epilogue_rows(const lora_args *l, const col_map *cm, int64_t s, int P, const uint32_t *vp0,
                                 const uint32_t *vp1, float *acc, int two) {
    const int g = cm->g[0], G = l->G;
    const int64_t step = 2 * l->out[g];
    const uint16_t *bp = pair_base(l, cm, s, 0);
    const uint32_t *v0g = vp0 + g, *v1g = vp1 + g;
    __m512 a0[2][NV], a1[2][NV];
    for (int q = 0; q < 2; q++)
        for (int j = 0; j < NV; j++) a0[q][j] = a1[q][j] = _mm512_setzero_ps();
    int kk = 0;
    for (; kk + 2 <= P; kk += 2, bp += 2 * step) {
        __m512bh e[NV], o[NV];
        for (int j = 0; j < NV; j++) {
            e[j] = (__m512bh)_mm512_loadu_si512(bp + 32 * j);
            o[j] = (__m512bh)_mm512_loadu_si512(bp + step + 32 * j);
        }
        for (int q = 0; q < 2; q++) {
            if (q && !two) break;
            const uint32_t *vg = q ? v1g : v0g;
            const __m512bh ve = (__m512bh)_mm512_set1_epi32((int)vg[kk * G]);
            const __m512bh vo = (__m512bh)_mm512_set1_epi32((int)vg[(kk + 1) * G]);
            for (int j = 0; j < NV; j++) {
                a0[q][j] = _mm512_dpbf16_ps(a0[q][j], e[j], ve);
                a1[q][j] = _mm512_dpbf16_ps(a1[q][j], o[j], vo);
            }
        }
    }
    if (kk < P)
        for (int q = 0; q < 2; q++) {
            if (q && !two) break;
            const __m512bh ve = (__m512bh)_mm512_set1_epi32((int)(q ? v1g : v0g)[kk * G]);
            for (int j = 0; j < NV; j++)
                a0[q][j] = _mm512_dpbf16_ps(a0[q][j], (__m512bh)_mm512_loadu_si512(bp + 32 * j), ve);
        }
    for (int q = 0; q < 2; q++) {
        if (q && !two) break;
        for (int j = 0; j < NV; j++) {
            float *c = acc + q * NB + 16 * j;
            const __m512 base = _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(_mm512_loadu_ps(c)));
            _mm512_storeu_ps(c, _mm512_add_ps(base, _mm512_add_ps(a0[q][j], a1[q][j])));
        }
    }
}

/* acc rows [0, mr) x columns [c0, c0 + ncols) (fp32, row stride NB) <- bf16(acc) + the LoRA deltas of those
 * rows, on vdpbf16ps (one instruction adds two ranks into 16 columns): the base rounded first and the
 * delta summed in lora_avx512bf16.h's order (expand_pairs_bf16), so the tile's final rounding gives the bits of
 * the GEMM followed by a separate LoRA kernel. */
static inline void lora_epilogue(const lora_args *l, const col_map *cm, int64_t m, int mr, int ncols, float *acc) {
    int one_output = ncols == NB;           /* the tile's columns all of one output: vectors side by side */
    for (int j = 1; j < NV; j++) one_output &= cm->g[j] == cm->g[0];
    for (int r = 0; r < mr; r++) {
        const int64_t s = l->slot[m + r];
        if (s < 0) continue;
        const int P = ((int)l->rank[m + r] + 1) / 2, G = l->G;
        const uint32_t *vp = l->vp + (m + r) * l->vp_stride;
        if (one_output) {   /* the same sums, the NV vectors' chains interleaved (each v pair broadcast once), two
                             * rows at a time where they share an adapter (each B line loaded once for both) */
            const int two = r + 1 < mr && l->slot[m + r + 1] == s && l->rank[m + r + 1] == l->rank[m + r];
            epilogue_rows(l, cm, s, P, vp, two ? vp + l->vp_stride : vp, acc + r * NB, two);
            r += two;       /* the next row shares this one's adapter: each B line loaded serves both */
            continue;
        }
        for (int j = 0; 16 * j < ncols; j++) {
            const int g = cm->g[j];
            const int64_t step = 2 * l->out[g];
            const uint16_t *bp = pair_base(l, cm, s, j);
            const uint32_t *vg = vp + g;
            __m512 a0 = _mm512_setzero_ps(), a1 = a0;
            int kk = 0;
            for (; kk + 2 <= P; kk += 2, bp += 2 * step) {   /* two chains: half the latency */
                a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(bp), (__m512bh)_mm512_set1_epi32((int)vg[kk * G]));
                a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(bp + step), (__m512bh)_mm512_set1_epi32((int)vg[(kk + 1) * G]));
            }
            if (kk < P)
                a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(bp), (__m512bh)_mm512_set1_epi32((int)vg[kk * G]));
            const __m512 base = _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(_mm512_loadu_ps(acc + r * NB + 16 * j)));
            _mm512_storeu_ps(acc + r * NB + 16 * j, _mm512_add_ps(base, _mm512_add_ps(a0, a1)));
        }
    }
}

/* Walks the B lines a tile's epilogue will read, one (row, rank pair) per call: one line per vector. */
typedef struct {
    const char *base[MR][NV];
    int64_t stride[MR][NV];
    int pairs[MR], r, k, mr, nv;
} lora_prefetch;

static inline void prefetch_init(lora_prefetch *pf, const lora_args *l, const col_map *cm, int64_t m, int mr, int ncols) {
    pf->r = pf->k = 0;
    pf->mr = mr;
    pf->nv = (ncols + 15) / 16;
    for (int r = 0; r < mr; r++) {
        const int64_t s = l->slot[m + r];
        const int again = r > 0 && s == l->slot[m + r - 1] && l->rank[m + r] == l->rank[m + r - 1];
        pf->pairs[r] = s < 0 || again ? 0 : ((int)l->rank[m + r] + 1) / 2;   /* its B lines: the row before's */
        for (int j = 0; j < pf->nv; j++) {
            pf->base[r][j] = (const char *)pair_base(l, cm, s < 0 ? 0 : s, j);
            pf->stride[r][j] = l->out[cm->g[j]] * 4;
        }
    }
}

static inline void prefetch_step(lora_prefetch *pf) {
    while (pf->r < pf->mr && pf->k >= pf->pairs[pf->r]) { pf->r++; pf->k = 0; }
    if (pf->r >= pf->mr) return;
    for (int j = 0; j < pf->nv; j++) _mm_prefetch(pf->base[pf->r][j] + pf->k * pf->stride[pf->r][j], _MM_HINT_T1);
    pf->k++;
}

/* y rows [0, mr) x columns [0, ncols) of one block; with l, rows m.. of the call get their LoRA deltas
 * before the single rounding (their B lines prefetched while the tile computes); with walk, a walker
 * step every PF_EVERY k steps; with next, this tile's share of the packed panel of the column block the
 * thread runs next: the k steps kp = share, share + shares, ... of it are prefetched as this tile reads
 * its own (the caller gives each of a block's `shares` row tiles its own share). The weights of a decode
 * step stream from memory, and the hardware prefetcher starts each new panel late; measured here, a
 * decode step's 30 layers 12-20% faster, lm_head 17-25%, than with no prefetch. */
static inline __attribute__((always_inline)) void tile_vnni(const uint16_t *x, int64_t xs, const uint16_t *p,
                                                            uint16_t *y, int64_t ys, int K, int mr, int ncols,
                                                            const lora_args *l, int64_t m, int c0, walker *walk,
                                                            const uint16_t *next, int share, int shares) {
    __m512 acc[MRV][NV];
    for (int r = 0; r < MRV; r++)
        for (int j = 0; j < NV; j++) acc[r][j] = _mm512_setzero_ps();
    const int32_t *xi[MRV];
    for (int r = 0; r < MRV; r++) xi[r] = (const int32_t *)(x + (r < mr ? r : 0) * xs);
    col_map cm;
    lora_prefetch pf;
    if (l) {
        cm = map_columns(l, c0, ncols);
        prefetch_init(&pf, l, &cm, m, mr, ncols);
    }
    for (int kp = 0; kp < K / 2; kp++) {
        if ((kp & (PF_EVERY - 1)) == 0) {   /* prefetches every few k steps: the k loop stays dense */
            if (l)
                for (int q = 0; q < PF_EVERY; q++) prefetch_step(&pf);
            if (walk) walker_step(walk);
        }
        __m512bh w[NV];
        if (next && share-- == 0) {
            for (int j = 0; j < NV; j++) _mm_prefetch((const char *)(next + (int64_t)kp * 2 * NB + 32 * j), _MM_HINT_T0);
            share = shares - 1;
        }
        for (int j = 0; j < NV; j++) w[j] = (__m512bh)_mm512_loadu_si512(p + 32 * j);
        p += 2 * NB;
#pragma GCC unroll 8
        for (int r = 0; r < MRV; r++) {
            const __m512bh b = (__m512bh)_mm512_set1_epi32(xi[r][kp]);
            for (int j = 0; j < NV; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], w[j], b);
        }
    }
    if (l) {
        float sums[MRV * NB];
        for (int r = 0; r < MRV; r++)
            for (int j = 0; j < NV; j++) _mm512_storeu_ps(sums + r * NB + 16 * j, acc[r][j]);
        lora_epilogue(l, &cm, m, mr, ncols, sums);
        for (int r = 0; r < MRV; r++)
            for (int j = 0; j < NV; j++) acc[r][j] = _mm512_loadu_ps(sums + r * NB + 16 * j);
    }
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < NV && 16 * j < ncols; j++) {
            const int c16 = ncols - 16 * j;
            const __mmask16 mask = c16 >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << c16) - 1);
            _mm256_mask_storeu_epi16(y + r * ys + 16 * j, mask, (__m256i)_mm512_cvtneps_pbh(acc[r][j]));
        }
}


#if GEMM_AMX
/* The same tile on AMX (Intel Sapphire Rapids and later): up to 16 rows x NB columns as three 16 x 16 fp32
 * tiles, k in steps of 32 by tdpbf16ps. The packed panel is already AMX's B layout: 16 pair rows of one
 * 16-column group are 16 lines of 64 bytes, 4 NB bytes apart. x rows are the A tile (rows = mr, set in
 * the tile configuration, so no row past the call's is read); the k steps past the last multiple of 32 run
 * on vdpbf16ps. Each output is one fp32 sum rounded once; its order of additions is the hardware's, the same
 * for every row, so a row's result still never depends on the rest of the batch. Tile configuration is
 * per thread and other libraries (oneDNN) set their own, so each tile loads its own. */
static inline void amx_configure(int mr) {
    amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 7; t++) {       /* 0-2: C (fp32 sums), 3: A (x rows), 4-6: B (the panel's groups) */
        c.colsb[t] = 64;
        c.rows[t] = t <= 3 ? mr : 16;
    }
    _tile_loadconfig(&c);
}

/* the prefetches a k step kp runs (as tile_vnni's loop does) */
static inline void amx_prefetches(int kp, const lora_args *l, lora_prefetch *pf, walker *walk,
                                  const uint16_t *next, int *share, int shares) {
    if ((kp & (PF_EVERY - 1)) == 0) {
        if (l)
            for (int q = 0; q < PF_EVERY; q++) prefetch_step(pf);
        if (walk) walker_step(walk);
    }
    if (next && (*share)-- == 0) {
        for (int j = 0; j < NV; j++) _mm_prefetch((const char *)(next + (int64_t)kp * 2 * NB + 32 * j), _MM_HINT_T0);
        *share = shares - 1;
    }
}

static inline __attribute__((always_inline)) void tile_amx(const uint16_t *x, int64_t xs, const uint16_t *p,
                                                           uint16_t *y, int64_t ys, int K, int mr, int ncols,
                                                           const lora_args *l, int64_t m, int c0, walker *walk,
                                                           const uint16_t *next, int share, int shares) {
    const int nv = (ncols + 15) / 16, k32 = K / 32 * 32;
    col_map cm;
    lora_prefetch pf;
    if (l) {
        cm = map_columns(l, c0, ncols);
        prefetch_init(&pf, l, &cm, m, mr, ncols);
    }
    amx_configure(mr);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    int kp = 0;
    for (int k = 0; k < k32; k += 32) {
        for (int q = 0; q < 16; q++, kp++) amx_prefetches(kp, l, &pf, walk, next, &share, shares);
        const uint16_t *pk = p + (int64_t)k * NB;          /* pair row k / 2 */
        _tile_loadd(3, x + k, xs * 2);
        _tile_loadd(4, pk, 4 * NB);
        _tile_dpbf16ps(0, 3, 4);
        if (nv > 1) {
            _tile_loadd(5, pk + 32, 4 * NB);
            _tile_dpbf16ps(1, 3, 5);
        }
        if (nv > 2) {
            _tile_loadd(6, pk + 64, 4 * NB);
            _tile_dpbf16ps(2, 3, 6);
        }
    }
    float sums[MR * NB];
    _tile_stored(0, sums, NB * 4);
    _tile_stored(1, sums + 16, NB * 4);
    _tile_stored(2, sums + 32, NB * 4);
    for (; kp < K / 2; kp++) {            /* the last k % 32 */
        amx_prefetches(kp, l, &pf, walk, next, &share, shares);
        for (int r = 0; r < mr; r++) {
            const __m512bh b = (__m512bh)_mm512_set1_epi32(((const int32_t *)(x + r * xs))[kp]);
            for (int j = 0; j < nv; j++) {
                const __m512bh w = (__m512bh)_mm512_loadu_si512(p + (int64_t)kp * 2 * NB + 32 * j);
                _mm512_storeu_ps(sums + r * NB + 16 * j, _mm512_dpbf16_ps(_mm512_loadu_ps(sums + r * NB + 16 * j), w, b));
            }
        }
    }
    if (l) lora_epilogue(l, &cm, m, mr, ncols, sums);
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < nv; j++) {
            const int c16 = ncols - 16 * j;
            const __mmask16 mask = c16 >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << c16) - 1);
            _mm256_mask_storeu_epi16(y + r * ys + 16 * j, mask, (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(sums + r * NB + 16 * j)));
        }
}
#endif

/* A tile of MR rows: on AMX where it runs, else as register tiles of MRV rows (the first carries the
 * prefetches). */
static inline __attribute__((always_inline)) void tile(const uint16_t *x, int64_t xs, const uint16_t *p, uint16_t *y,
                                                       int64_t ys, int K, int mr, int ncols, const lora_args *l,
                                                       int64_t m, int c0, walker *walk,
                                                       const uint16_t *next, int share, int shares) {
#if GEMM_AMX
    if (amx_on) {
        tile_amx(x, xs, p, y, ys, K, mr, ncols, l, m, c0, walk, next, share, shares);
        return;
    }
#endif
    tile_vnni(x, xs, p, y, ys, K, mr < MRV ? mr : MRV, ncols, l, m, c0, walk, next, share, shares);
    for (int r = MRV; r < mr; r += MRV)
        tile_vnni(x + r * xs, xs, p, y + r * ys, ys, K, mr - r < MRV ? mr - r : MRV, ncols, l, m + r, c0, 0, 0, 0, 1);
}
