/* y[M, N] = x[M, K] @ W^T for bf16 x, W and y on CPUs with AVX2 and FMA but no AVX512-BF16 (AMD Zen 2-4,
 * Intel before Cooper Lake): bf16 is stored, fp32 is computed.
 *
 * Packed W (see gemm.py, pack(weight, 16)): [ceil(N / 16)][K / 2][16][2], columns past N zero; one 64-byte
 * line holds 16 columns x 2 consecutive k. A 32-byte load of it is 8 columns x 2 k: shifting each 32-bit
 * lane left by 16 gives the even k as fp32, masking off the low half gives the odd k, exactly (bf16 is
 * the top half of an fp32). x is converted to fp32 once per call.
 *
 * Register tile: MR rows x 16 columns (MR x 2 ymm accumulators), over the whole K in order k = 0, 1, ...;
 * a task with more than MR rows first widens its panel to fp32 once (widen_panel) and runs MR32-row tiles
 * over it (tile_f32), with the same FMAs in the same order;
 * each output is one fp32 sum rounded once to bf16, so a row's result never depends on the rest of the
 * batch (the engine's batch invariance rests on it).
 * Work: tasks of (row block of <= MC rows, column block), split statically over the OpenMP threads.
 */
#include "loraplex_kernels.h"
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"

#define NC 16   /* columns per packed block */
#define MR 5    /* rows per register tile: 10 accumulators + 2 raw + 2 converted weight vectors + 1 broadcast + mask = 16 ymm */
#define MC 96   /* rows per task at most: the task's fp32 x rows stay in L2 */

/* y rows [0, mr) x columns [0, ncols) = out rounded once to bf16 (out: [rows][16] fp32) */
static inline void store_rows(const float *out, uint16_t *y, int64_t ys, int mr, int ncols) {
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < ncols; c++) y[r * ys + c] = f32_to_bf16(out[r * NC + c]);
}

/* NOTE: the accumulators go through a local array: passing their address to a helper kept them in memory
 * (a store per FMA pair in the k loop, half the speed). */
#define STORE_TILE(acc, rows, y, ys, mr, ncols)                       \
    do {                                                              \
        float out_[(rows) * NC];                                      \
        for (int r_ = 0; r_ < (rows); r_++) {                         \
            _mm256_storeu_ps(out_ + r_ * NC, acc[r_][0]);             \
            _mm256_storeu_ps(out_ + r_ * NC + 8, acc[r_][1]);         \
        }                                                             \
        store_rows(out_, y, ys, mr, ncols);                           \
    } while (0)

/* y rows [0, mr) x columns [0, ncols) of one column block; x: fp32 rows at stride K; p: the block's panel */
static inline __attribute__((always_inline)) void tile(const float *x, const uint16_t *p, uint16_t *y, int64_t ys,
                                                       int K, int mr, int ncols) {
    __m256 acc[MR][2];
    for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const float *xr[MR];
    for (int r = 0; r < MR; r++) xr[r] = x + (int64_t)(r < mr ? r : 0) * K;
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
    for (int k = 0; k < K; k += 2, p += 2 * NC) {
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)p), w1 = _mm256_loadu_si256((const __m256i *)(p + 16));
        __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(w0, 16)), b = _mm256_castsi256_ps(_mm256_slli_epi32(w1, 16));
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) {
            const __m256 xv = _mm256_broadcast_ss(xr[r] + k);
            acc[r][0] = _mm256_fmadd_ps(a, xv, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(b, xv, acc[r][1]);
        }
        a = _mm256_castsi256_ps(_mm256_and_si256(w0, hi));
        b = _mm256_castsi256_ps(_mm256_and_si256(w1, hi));
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) {
            const __m256 xv = _mm256_broadcast_ss(xr[r] + k + 1);
            acc[r][0] = _mm256_fmadd_ps(a, xv, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(b, xv, acc[r][1]);
        }
    }
    STORE_TILE(acc, MR, y, ys, mr, ncols);   /* lane j of w0 is column j, of w1 column 8 + j */
}

/* The same tile over a panel already converted to fp32 ([K][16], see widen_panel): no conversion in the k
 * loop, one more row. The FMAs and their order are those of tile(), so both give identical bits. */
#define MR32 6
static inline __attribute__((always_inline)) void tile_f32(const float *x, const float *w, uint16_t *y, int64_t ys,
                                                           int K, int mr, int ncols) {
    __m256 acc[MR32][2];
    for (int r = 0; r < MR32; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const float *xr[MR32];
    for (int r = 0; r < MR32; r++) xr[r] = x + (int64_t)(r < mr ? r : 0) * K;
    for (int k = 0; k < K; k++, w += NC) {
        const __m256 a = _mm256_loadu_ps(w), b = _mm256_loadu_ps(w + 8);
#pragma GCC unroll 8
        for (int r = 0; r < MR32; r++) {
            const __m256 xv = _mm256_broadcast_ss(xr[r] + k);
            acc[r][0] = _mm256_fmadd_ps(a, xv, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(b, xv, acc[r][1]);
        }
    }
    STORE_TILE(acc, MR32, y, ys, mr, ncols);
}

/* packed panel [K / 2][16][2] bf16 -> w [K][16] fp32 */
static void widen_panel(const uint16_t *p, float *w, int K) {
    for (int kp = 0; kp < K / 2; kp++)
        for (int c = 0; c < NC; c++) {
            w[(2 * kp) * NC + c] = bf16_to_f32(p[(kp * NC + c) * 2]);
            w[(2 * kp + 1) * NC + c] = bf16_to_f32(p[(kp * NC + c) * 2 + 1]);
        }
}

/* a [K, 16] fp32 panel, 64-byte aligned: each k's 16 columns one cache line (free() it) */
static inline float *panel_alloc(int K) { return aligned_alloc(64, sizeof(float) * (size_t)K * NC); }

/* How a call's rows and column blocks become tasks: (row block of <= MC rows, column block). */
typedef struct {
    const float *xf;          /* [M, K] fp32 */
    const uint16_t *p;
    uint16_t *y;
    int64_t ys;
    int M, K, N, nblocks, mblocks, mc;
} gemm_plan;

static gemm_plan plan_gemm(const float *xf, const uint16_t *p, uint16_t *y, int64_t ys, int M, int K, int N) {
    gemm_plan g = {xf, p, y, ys, M, K, N, (N + NC - 1) / NC, (M + MC - 1) / MC, 0};
    g.mc = ((M + g.mblocks - 1) / g.mblocks + MR - 1) / MR * MR;   /* balanced row blocks */
    return g;
}

/* task mb * nblocks + nb: rows of row block mb x column block nb; w: NULL, or a [K, 16] fp32 panel
 * (widened once when the task has more than MR rows) */
static inline __attribute__((always_inline)) void gemm_task(const gemm_plan *g, int task, float *w) {
    const int mb = task / g->nblocks, nb = task % g->nblocks, K = g->K;
    const int m0 = mb * g->mc, m1 = m0 + g->mc < g->M ? m0 + g->mc : g->M;
    const int ncols = g->N - nb * NC < NC ? g->N - nb * NC : NC;
    const uint16_t *pn = g->p + (int64_t)nb * K * NC;
    uint16_t *yb = g->y + nb * NC;
    if (w && m1 - m0 > MR) {   /* several row tiles: widen the panel once, then pure fp32 tiles */
        widen_panel(pn, w, K);
        for (int m = m0; m < m1; m += MR32)
            tile_f32(g->xf + (int64_t)m * K, w, yb + (int64_t)m * g->ys, g->ys, K, m1 - m < MR32 ? m1 - m : MR32, ncols);
    } else {
        for (int m = m0; m < m1; m += MR)
            tile(g->xf + (int64_t)m * K, pn, yb + (int64_t)m * g->ys, g->ys, K, m1 - m < MR ? m1 - m : MR, ncols);
    }
}

/* xf [M, K] = x as fp32 (every thread of the region takes its share of rows; no barrier) */
static inline void widen_rows_for(const uint16_t *x, int64_t xs, float *xf, int M, int K) {
#pragma omp for schedule(static) nowait
    for (int m = 0; m < M; m++)
        for (int k = 0; k < K; k++) xf[(int64_t)m * K + k] = bf16_to_f32(x[m * xs + k]);
}

/* x: [M, K] bf16 rows at stride xs; p: packed W; y: [M, N] rows at stride ys.
 * Returns 0, -1 for an odd K, -2 when the fp32 copy of x cannot be allocated. */
int gemm_bf16_avx2(const uint16_t *x, int64_t xs, const uint16_t *p, uint16_t *y, int64_t ys, int M, int K, int N) {
    if (K % 2) return -1;
    if (M <= 0) return 0;
    float *xf = malloc(sizeof(float) * (size_t)M * K);   /* xf: [M, K] fp32 */
    if (!xf) return -2;
    const gemm_plan g = plan_gemm(xf, p, y, ys, M, K, N);
#pragma omp parallel
    {
        widen_rows_for(x, xs, xf, M, K);
        /* w: [K, 16] fp32 panel; without it (M <= MR, or no memory) tile() converts in registers */
        float *w = M > MR ? panel_alloc(K) : NULL;
#pragma omp barrier
#pragma omp for schedule(static)
        for (int task = 0; task < g.mblocks * g.nblocks; task++) gemm_task(&g, task, w);
        free(w);
    }
    free(xf);
    return 0;
}
