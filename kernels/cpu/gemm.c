/* y[M, N] = x[M, K] @ W^T in bf16 with fp32 accumulation (AVX512-BF16 vdpbf16ps), W pre-packed, and,
 * optionally, software prefetch of the step's multi-LoRA weights while the GEMM computes.
 *
 * Packed W (see gemm.py): [ceil(N / NB)][K / 2][NB][2], NB = 48 columns per block, columns past N zero;
 * element (n, k) sits at block n / NB, pair k / 2, lane n % NB, half k % 2, so one 64-byte load holds 16
 * columns x 2 consecutive k: exactly vdpbf16ps's operand. K must be even.
 *
 * Work: tasks of (row block of <= MC rows, column block), split statically over the OpenMP threads; a
 * task runs MR x NB register tiles (8 x 3 zmm accumulators) over the whole K. Each output is one fp32 sum
 * rounded once to bf16, so a row's result never depends on the other rows of the batch.
 *
 * The decode GEMMs are compute-bound while the LoRA weights they are followed by are read from memory
 * once per step (64 distinct rank-16 adapters: 2.3x the base model's bytes). Given a `lora_plan`, every
 * thread spreads prefetches of its share of those bytes (every listed token's A and B rows) over its
 * GEMM tiles, so the LoRA kernel that follows finds them in L2/L3 instead of waiting on DRAM.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#define NV 3              /* zmm accumulators per row of a tile */
#define NB (16 * NV)      /* columns per block */
#define MR 8              /* rows per tile */
#define MC 96             /* rows per task at most: the task's x rows stay in L2 */
#define MAX_GROUPS 3

/* Where one layer's fused LoRA group lives (the slot layout of engine/lora/slots.py): slot s's A is
 * a + s * a_slot (bytes), rank k's rows at + k * a_rank; B of output g at b[g] + s * b_slot[g], rank k
 * at + k * b_rank[g]. An adapter of rank r reads [0, r * a_rank) and [0, r * b_rank[g]). */
typedef struct {
    const char *a;
    int64_t a_slot, a_rank;
    int groups;
    const char *b[MAX_GROUPS];
    int64_t b_slot[MAX_GROUPS], b_rank[MAX_GROUPS];
} lora_plan;

/* Walks the byte ranges of tokens [i, end) of a plan, one 64-byte line per step. */
typedef struct {
    const lora_plan *plan;
    const int64_t *slot, *rank;
    int i, end, part;        /* token, one past the last token, range within the token (0 = A, g + 1 = B_g) */
    const char *p, *stop;
    int64_t left;            /* lines not yet prefetched */
} cursor;

static void cur_range(cursor *c) {
    while (c->i < c->end) {
        const lora_plan *pl = c->plan;
        const int64_t s = c->slot[c->i], r = c->rank[c->i];
        if (c->part == 0) { c->p = pl->a + s * pl->a_slot; c->stop = c->p + r * pl->a_rank; }
        else { const int g = c->part - 1; c->p = pl->b[g] + s * pl->b_slot[g]; c->stop = c->p + r * pl->b_rank[g]; }
        if (c->p < c->stop) return;
        if (++c->part > pl->groups) { c->part = 0; c->i++; }
    }
    c->p = c->stop = 0;
}

static void cur_init(cursor *c, const lora_plan *plan, const int64_t *slot, const int64_t *rank, int lo, int hi) {
    c->plan = plan; c->slot = slot; c->rank = rank; c->i = lo; c->end = hi; c->part = 0; c->left = 0;
    if (!plan) { c->i = hi; c->p = c->stop = 0; return; }
    for (int i = lo; i < hi; i++) {
        int64_t bytes = rank[i] * plan->a_rank;
        for (int g = 0; g < plan->groups; g++) bytes += rank[i] * plan->b_rank[g];
        c->left += (bytes + 63) / 64;
    }
    cur_range(c);
}

/* the next up to `max` line addresses into `out`; returns how many */
static int cur_take(cursor *c, const char **out, int max) {
    int k = 0;
    while (k < max && c->p) {
        out[k++] = c->p;
        c->p += 64;
        if (c->p >= c->stop) {
            if (++c->part > c->plan->groups) { c->part = 0; c->i++; }
            cur_range(c);
        }
    }
    c->left -= k;
    return k;
}

/* y rows [0, mr) x columns [0, ncols) of one block, prefetching lines[0, nl) on the way, q per k pair */
static inline void tile(const uint16_t *x, int64_t xs, const uint16_t *p, uint16_t *y, int64_t ys, int K,
                        int mr, int ncols, const char *const *lines, int nl, int q) {
    __m512 acc[MR][NV];
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < NV; j++) acc[r][j] = _mm512_setzero_ps();
    const int32_t *xi[MR];
    for (int r = 0; r < MR; r++) xi[r] = (const int32_t *)(x + (r < mr ? r : 0) * xs);
    for (int kp = 0; kp < K / 2; kp++) {
        for (int u = 0; u < q && nl > 0; u++, nl--) _mm_prefetch(*lines++, _MM_HINT_T1);
        __m512bh w[NV];
        for (int j = 0; j < NV; j++) w[j] = (__m512bh)_mm512_loadu_si512(p + 32 * j);
        p += 2 * NB;
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) {
            const __m512bh b = (__m512bh)_mm512_set1_epi32(xi[r][kp]);
            for (int j = 0; j < NV; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], w[j], b);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < NV && 16 * j < ncols; j++) {
            const int c16 = ncols - 16 * j;
            const __mmask16 m = c16 >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << c16) - 1);
            _mm256_mask_storeu_epi16(y + r * ys + 16 * j, m, (__m256i)_mm512_cvtneps_pbh(acc[r][j]));
        }
}

/* x: [M, K] rows at stride xs; y: [M, N] rows at stride ys; p: packed W. plan may be NULL; otherwise
 * slot[i], rank[i] for i < n name the LoRA rows to prefetch. Returns 0, or -1 for an odd K. */
int gemm_bf16(const uint16_t *x, int64_t xs, const uint16_t *p, uint16_t *y, int64_t ys, int M, int K, int N,
              const lora_plan *plan, int n, const int64_t *slot, const int64_t *rank) {
    if (K % 2 || M <= 0) return K % 2 ? -1 : 0;
    const int nblocks = (N + NB - 1) / NB, mblocks = (M + MC - 1) / MC;
    const int mc = ((M + mblocks - 1) / mblocks + MR - 1) / MR * MR;   /* balanced row blocks */
    const int tasks = mblocks * nblocks;
#pragma omp parallel
    {
        const int nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int lo = (int)((int64_t)tasks * t / nt), hi = (int)((int64_t)tasks * (t + 1) / nt);
        cursor c;
        cur_init(&c, plan, slot, rank, (int)((int64_t)n * t / nt), (int)((int64_t)n * (t + 1) / nt));
        int64_t iters = 0;   /* k-pair iterations this thread runs: the prefetches are spread over them */
        for (int task = lo; task < hi; task++) {
            const int mb = task / nblocks, m0 = mb * mc, m1 = m0 + mc < M ? m0 + mc : M;
            iters += (int64_t)((m1 - m0 + MR - 1) / MR) * (K / 2);
        }
        const int qmax = iters > 0 ? (int)((c.left + iters - 1) / iters) : 0;
        const char **lines = qmax > 0 ? (const char **)malloc(sizeof(char *) * (size_t)qmax * (K / 2)) : NULL;
        for (int task = lo; task < hi; task++) {
            const int mb = task / nblocks, nb = task % nblocks;
            const int m0 = mb * mc, m1 = m0 + mc < M ? m0 + mc : M;
            const int ncols = N - nb * NB < NB ? N - nb * NB : NB;
            const uint16_t *pn = p + (int64_t)nb * K * NB;
            for (int m = m0; m < m1; m += MR) {
                const int q = lines && iters > 0 ? (int)((c.left + iters - 1) / iters) : 0;
                const int nl = q > 0 ? cur_take(&c, lines, q * (K / 2)) : 0;
                tile(x + (int64_t)m * xs, xs, pn, y + (int64_t)m * ys + nb * NB, ys, K, m1 - m < MR ? m1 - m : MR,
                     ncols, lines, nl, q);
                iters -= K / 2;
            }
        }
        free(lines);
    }
    return 0;
}
