/* Multi-LoRA of up to AT = 16 tokens of one adapter on AMX tiles (lora.c's segment kernel where AMX runs;
 * on such a CPU every token with an adapter goes there, decode tokens grouped by adapter too):
 *     shrink  V^T [r G, tokens] = A [r G, in] X^T     A's rows as the A tile (read in place), X transposed
 *                                                     into k pairs (xp [in / 2][16][2]) as the B tile
 *     expand  Y_g [tokens, out_g] += V_g [tokens, r] Bt_g   V_g rounded to bf16 pairs (as a bf16 LoRA keeps
 *                                                     A x) as the A tile, Bt_g's paired layout
 *                                                     (lora_avx512bf16.h) is already AMX's B layout
 * A token is one column of the shrink and one row of the expand: its sums never meet another token's, and
 * their order is the hardware's, the same in every task, so a token's bits do not depend on which tokens
 * share its task or its step (nor on how its prompt was chunked: decode and prefill tokens alike run here).
 * Each output: the expand's fp32 sum from zero, added to the bf16 y and rounded once.
 * Needs in % 32 == 0 and every out_g % 16 == 0 (amx_lora_fits); otherwise lora.c's vdpbf16ps tiles run.
 * The tile configuration is per thread and the GEMM tiles set their own, so each step loads its own. */
#pragma once
#include "amx.h"
#include "walker.h"

#if GEMM_AMX
#define AT 16            /* tokens per task on AMX */
#define PF_K 256         /* shrink: how far ahead (in elements of in) each row of A is prefetched */

static inline int amx_lora_fits(int in, int G, const int64_t *out) {
    if (in % 32) return 0;
    for (int g = 0; g < G; g++)
        if (out[g] % 16) return 0;
    return 1;
}

/* tiles 0-3: C; 4-7 as the caller uses them (rows 0: unused) */
static inline void amx_tiles(const uint8_t rows[8], const uint16_t colsb[8]) {
    amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = rows[t];
        c.colsb[t] = rows[t] ? colsb[t] : 0;
    }
    _tile_loadconfig(&c);
}

/* xp[kk][t] = x_t's k pair kk for t < nt, 0 for the other of the 16 columns; *filled: the columns not
 * zero in xp (the previous task's nt; 0 for a zeroed buffer), so only those are cleared again */
static inline void transpose_pairs(const uint16_t *const *xs, int nt, int in, uint32_t *xp, int *filled) {
    for (int t = 0; t < nt; t++) {
        const uint32_t *xt = (const uint32_t *)xs[t];
        for (int kk = 0; kk < in / 2; kk++) xp[kk * AT + t] = xt[kk];
    }
    for (int t = nt; t < *filled; t++)
        for (int kk = 0; kk < in / 2; kk++) xp[kk * AT + t] = 0u;
    *filled = nt;
}

/* vt[row][t] = A[row] . x_t for row < rows, t < 16: four 16-row blocks of A per pass over k, the pass's
 * last block (tile 6) configured to the rows left, so no row past A's is read */
static void shrink_amx(const uint32_t *xp, const uint16_t *as, int rows, int in, float *vt, walker *pf) {
    for (int r0 = 0; r0 < rows; r0 += 64) {
        const int left = rows - r0 < 64 ? rows - r0 : 64, nblk = (left + 15) / 16, last = left - 16 * (nblk - 1);
        uint8_t tr[8] = {16, 16, 16, 16, 16, 16, (uint8_t)last, 0};
        const uint16_t cb[8] = {64, 64, 64, 64, 64, 64, 64, 0};
        tr[nblk - 1] = (uint8_t)last;
        amx_tiles(tr, cb);
        _tile_zero(0);
        if (nblk > 1) _tile_zero(1);
        if (nblk > 2) _tile_zero(2);
        if (nblk > 3) _tile_zero(3);
        const int64_t st = (int64_t)in * 2;
        for (int k = 0; k < in; k += 32) {
            if (pf) walker_step(pf);
            _tile_loadd(5, xp + k / 2 * AT, AT * 4);
            const uint16_t *a0 = as + (int64_t)r0 * in + k;
            if (k + PF_K < in)      /* each row's line PF_K elements ahead: 16 strided streams a tile */
                for (int q = 0; q < left; q++) _mm_prefetch((const char *)(a0 + (int64_t)q * in + PF_K), _MM_HINT_T0);
            if (nblk == 1) { _tile_loadd(6, a0, st); _tile_dpbf16ps(0, 6, 5); continue; }
            _tile_loadd(4, a0, st); _tile_dpbf16ps(0, 4, 5);
            if (nblk == 2) { _tile_loadd(6, a0 + 16 * (int64_t)in, st); _tile_dpbf16ps(1, 6, 5); continue; }
            _tile_loadd(4, a0 + 16 * (int64_t)in, st); _tile_dpbf16ps(1, 4, 5);
            if (nblk == 3) { _tile_loadd(6, a0 + 32 * (int64_t)in, st); _tile_dpbf16ps(2, 6, 5); continue; }
            _tile_loadd(4, a0 + 32 * (int64_t)in, st); _tile_dpbf16ps(2, 4, 5);
            _tile_loadd(6, a0 + 48 * (int64_t)in, st); _tile_dpbf16ps(3, 6, 5);
        }
        float *v = vt + (int64_t)r0 * AT;
        _tile_stored(0, v, AT * 4);
        if (nblk > 1) _tile_stored(1, v + 16 * AT, AT * 4);
        if (nblk > 2) _tile_stored(2, v + 32 * AT, AT * 4);
        if (nblk > 3) _tile_stored(3, v + 48 * AT, AT * 4);
    }
}

/* y_t[0, o) += sum_k v_t[k] Bt[k] for t < nt: vg [AT][vs] token t's rank pairs of this output (bs paired,
 * pair rows o * 2 apart); 64 columns (four C tiles) per pass over the ranks, 16 pairs per k step, the last
 * step's pairs (tiles 6, 7) configured to the ranks left, so no pair row past B's is read. */
static void expand_amx(const uint16_t *bs, int64_t o, int r, const uint32_t *vg, int vs, int nt,
                       uint16_t *const *ys, int64_t col, walker *pf) {
    const int P = (r + 1) / 2, full = P / 16 * 16, rem = P - full;
    const uint8_t tr[8] = {(uint8_t)nt, (uint8_t)nt, (uint8_t)nt, (uint8_t)nt, full ? (uint8_t)nt : 0, full ? 16 : 0,
                           rem ? (uint8_t)nt : 0, (uint8_t)rem};
    const uint16_t cb[8] = {64, 64, 64, 64, 64, 64, (uint16_t)(4 * rem), 64};
    amx_tiles(tr, cb);
    float sums[AT * 64];
    for (int64_t c = 0; c < o; c += 64) {
        const int nc = (int)(o - c < 64 ? (o - c) / 16 : 4);
        if (pf) walker_step(pf);
        if (c + 64 < o)             /* the next 64 columns' lines of every pair row */
            for (int p = 0; p < P; p++)
                for (int q = 0; q < 4 && c + 64 + 16 * q < o; q++)
                    _mm_prefetch((const char *)(bs + ((int64_t)p * o + c + 64 + 16 * q) * 2), _MM_HINT_T0);
        _tile_zero(0);
        if (nc > 1) _tile_zero(1);
        if (nc > 2) _tile_zero(2);
        if (nc > 3) _tile_zero(3);
/* pairs from p0 (A tile TA: the tokens' v there; B tile TB: B's pair rows there) into the nc C tiles */
#define EXPAND_STEP(TA, TB, p0)                                                                              \
        do {                                                                                                 \
            const uint16_t *b0 = bs + ((int64_t)(p0) * o + c) * 2;                                           \
            _tile_loadd(TA, vg + (p0), vs * 4);                                                              \
            _tile_loadd(TB, b0, o * 4); _tile_dpbf16ps(0, TA, TB);                                           \
            if (nc > 1) { _tile_loadd(TB, b0 + 32, o * 4); _tile_dpbf16ps(1, TA, TB); }                      \
            if (nc > 2) { _tile_loadd(TB, b0 + 64, o * 4); _tile_dpbf16ps(2, TA, TB); }                      \
            if (nc > 3) { _tile_loadd(TB, b0 + 96, o * 4); _tile_dpbf16ps(3, TA, TB); }                      \
        } while (0)
        for (int p0 = 0; p0 < full; p0 += 16) EXPAND_STEP(4, 5, p0);
        if (rem) EXPAND_STEP(6, 7, full);
#undef EXPAND_STEP
        _tile_stored(0, sums, 64 * 4);
        if (nc > 1) _tile_stored(1, sums + 16, 64 * 4);
        if (nc > 2) _tile_stored(2, sums + 32, 64 * 4);
        if (nc > 3) _tile_stored(3, sums + 48, 64 * 4);
        for (int t = 0; t < nt; t++) {
            uint16_t *yt = ys[t] + col + c;
            for (int j = 0; j < nc; j++) {
                const __m512 a = _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256((const __m256i *)(yt + 16 * j)));
                const __m512 d = _mm512_loadu_ps(sums + t * 64 + 16 * j);
                _mm256_storeu_si256((__m256i *)(yt + 16 * j), (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(a, d)));
            }
        }
    }
}

/* One task: tokens xs / ys (nt <= AT) of one adapter (as, bs[g], rank r): their deltas into y. xp: scratch of
 * in * AT / 2 pairs (64-byte aligned, *filled its non-zero columns: transpose_pairs); vt: of r G x AT floats. */
static void task_amx(const uint16_t *const *xs, uint16_t *const *ys, int nt, const uint16_t *as,
                     const uint16_t *const *bs, int r, int G, int in, const int64_t *out, uint32_t *xp, int *filled,
                     float *vt, walker *pf) {
    transpose_pairs(xs, nt, in, xp, filled);
    shrink_amx(xp, as, r * G, in, vt, pf);
    const int P = (r + 1) / 2, vs = (P + 15) / 16 * 16;
    uint32_t vg[AT * 128];
    int64_t col = 0;
    for (int g = 0; g < G; g++) {
        for (int t = 0; t < nt; t++)           /* rank row k of output g is A's row k G + g */
            for (int kk = 0; kk < P; kk++) {
                const float lo = vt[(2 * kk * G + g) * AT + t];
                const float hi = 2 * kk + 1 < r ? vt[((2 * kk + 1) * G + g) * AT + t] : 0.f;
                vg[t * vs + kk] = bf16_pair(lo, hi);
            }
        expand_amx(bs[g], out[g], r, vg, vs, nt, ys, col, pf);
        col += out[g];
    }
}

/* walker steps task_amx takes (shrink k steps, expand column blocks) */
static inline int64_t task_amx_steps(int r, int G, int in, const int64_t *out) {
    int64_t n = (int64_t)((r * G + 63) / 64) * (in / 32);
    for (int g = 0; g < G; g++) n += (out[g] + 63) / 64;
    return n;
}

/* pf: the bytes of a task (adapter as / bs, rank r) spread over `steps` walker steps */
static inline void walk_task(walker *pf, const uint16_t *as, int r, int G, int in, const uint16_t *const *bs,
                             const int64_t *out, int64_t steps) {
    walker_reset(pf);
    walker_add(pf, as, (int64_t)r * G * in * 2);
    for (int g = 0; g < G; g++) walker_add(pf, bs[g], (int64_t)(r + 1) / 2 * out[g] * 4);
    pf->per_step = (int)(walker_lines(pf) / (steps > 0 ? steps : 1)) + 1;
}
#endif
