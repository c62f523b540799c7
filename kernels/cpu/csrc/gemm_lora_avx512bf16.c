/* The bf16 base GEMM of one fused projection group with the multi-LoRA of its decode rows inside it:
 *     y = x @ W^T;   y[t, cols of output g] += B_g[s]^T (A[s] x[t])   for each row t with slot s = slot[t] >= 0
 * (rank rank[t]; A [S][R][G][K] rank-major, B_g [S][ceil(R / 2)][out_g][2] transposed, pre-scaled and in
 * lora_avx512bf16.h's paired layout: the LoRA slots). The intermediate A x is rounded to bf16 (as a bf16 LoRA).
 *
 * The adapters' bytes are what a decode step's LoRA costs (each row its own adapter: memory-bound), while
 * the GEMM is compute-bound; here the two overlap. The column blocks are split in two phases:
 *   1. the first blocks' tiles (plain), and between them the shrinks v[t] = A[s] x[t];
 *   2. (after a barrier) the other blocks' tiles, which add their rows' expand before rounding (the
 *      epilogue of gemm_tile.h), and between them the expand of phase 1's columns into y (y rounded
 *      twice there, as an unfused LoRA does).
 * Each thread runs a contiguous range of tiles; each tile carries its share of the memory-bound steps, run
 * after it, whose bytes are prefetched while it computes (gemm_tile.h's walker). A step is a group of up to
 * GROUP_ROWS rows side by side with one adapter and rank (the engine orders a step's rows by adapter): each
 * weight load serves all of them, as in the epilogue, where two such rows share each B line. Phase 1's share of the
 * columns follows A's share of the adapter bytes.
 * Every row is computed on its own: results never depend on the rest of the batch.
 */
#include "loraplex_kernels.h"
#include <omp.h>
#include <stdlib.h>

#include "gemm_avx512bf16.c"   /* gemm_for: a call with no adapter row is the plain GEMM */
#include "lora_avx512bf16.h"

#define MAX_GROUPS 3
#define MAX_ROWS (256 * MAX_GROUPS)

typedef struct {
    const uint16_t *x, *p;
    uint16_t *y;
    int64_t xs, ys;
    int M, K, N, nblocks, mblocks, mc;
    const int64_t *rows;      /* the rows with an adapter */
    int nrows;
    const int *group;         /* [ngroups + 1]: rows[group[i], group[i + 1]) share slot and rank (row_groups) */
    int ngroups;              /* the memory-bound steps of each phase: one a group */
    const uint16_t *const *a; /* [S] each slot's A */
    lora_args l;
    uint32_t *vp;
    int64_t vp_stride;
    int split;                /* column blocks [0, split) are phase 1's */
} job;

/* A phase's tasks are single tiles, ordered by row block, then column block in [c0, c1), then row tile,
 * so that the tiles of a column block run close together (its packed weights stay in L2). */
static int tile_count(const job *j, int c0, int c1) {
    return (j->M + MR - 1) / MR * (c1 - c0);   /* row blocks but the last hold whole tiles (mc % MR == 0) */
}

static void run_tile(const job *j, int c0, int c1, int task, const lora_args *l, walker *w) {
    const int ncb = c1 - c0;
    int mb = 0, rest = task;
    for (;;) {
        const int m0 = mb * j->mc, tiles = ((j->M - m0 < j->mc ? j->M - m0 : j->mc) + MR - 1) / MR;
        if (rest < tiles * ncb || mb == j->mblocks - 1) {
            const int nb = c0 + rest / tiles, m = m0 + rest % tiles * MR;
            const int m1 = m0 + j->mc < j->M ? m0 + j->mc : j->M, mr = m1 - m < MR ? m1 - m : MR;
            const int ncols = j->N - nb * NB < NB ? j->N - nb * NB : NB;
            const uint16_t *pn = j->p + (int64_t)nb * j->K * NB;
            uint16_t *ym = j->y + (int64_t)m * j->ys + nb * NB;
            const uint16_t *next = nb + 1 < c1 ? pn + (int64_t)j->K * NB : 0;   /* see tile() */
            const int share = rest % tiles;
            if (l) tile(j->x + (int64_t)m * j->xs, j->xs, pn, ym, j->ys, j->K, mr, ncols, l, m, nb * NB, w, next, share, tiles);
            else tile(j->x + (int64_t)m * j->xs, j->xs, pn, ym, j->ys, j->K, mr, ncols, 0, m, nb * NB, w, next, share, tiles);
            return;
        }
        rest -= tiles * ncb;
        mb++;
    }
}

/* phase 1's step i: the shrinks of group i's rows (their adapter's A read once for all of them) */
static void shrink_step(const job *j, int i, walker *w, int fetch) {
    const int first = j->group[i], nt = j->group[i + 1] - first;
    const int64_t t = j->rows[first], s = j->l.slot[t];
    const uint16_t *as = j->a[s];
    const int r = (int)j->l.rank[t], n = r * j->l.G;
    if (fetch) { walker_add(w, as, (int64_t)n * j->K * 2); return; }
    if (nt == 1) {
        float v[MAX_ROWS];
        shrink_bf16(j->x + t * j->xs, as, n, j->K, v);
        pair_v(v, r, j->l.G, j->vp + t * j->vp_stride);
        return;
    }
    float v[GROUP_ROWS][MAX_ROWS], *vs[GROUP_ROWS];
    const uint16_t *xs[GROUP_ROWS] = {0};
    for (int q = 0; q < nt; q++) {
        xs[q] = j->x + j->rows[first + q] * j->xs;
        vs[q] = v[q];
    }
    shrink_rows_bf16(xs, nt, as, n, j->K, vs);
    for (int q = 0; q < nt; q++) pair_v(v[q], r, j->l.G, j->vp + j->rows[first + q] * j->vp_stride);
}

/* phase 2's step i: group i's rows' expand over the columns of phase 1, [0, split * NB) */
static void expand_step(const job *j, int i, walker *w, int fetch) {
    const int first = j->group[i], nt = j->group[i + 1] - first;
    const int64_t t = j->rows[first], s = j->l.slot[t];
    const int r = (int)j->l.rank[t];
    const int64_t end = (int64_t)j->split * NB < j->N ? (int64_t)j->split * NB : j->N;
    int64_t start = 0;
    for (int g = 0; g < j->l.G && start < end; g++) {
        const int64_t o = j->l.out[g], n = end - start < o ? end - start : o;
        const uint16_t *b = j->l.b[s * j->l.G + g];
        if (fetch) {
            for (int k = 0; k < r; k += 2) walker_add(w, b + k * o, n * 4);
        } else if (nt == 1) {
            expand_pairs_bf16(b, n, o, r, j->vp + t * j->vp_stride + g, j->l.G, j->y + t * j->ys + start);
        } else {
            const uint32_t *vps[GROUP_ROWS];
            uint16_t *ys[GROUP_ROWS];
            for (int q = 0; q < nt; q++) {
                vps[q] = j->vp + j->rows[first + q] * j->vp_stride + g;
                ys[q] = j->y + j->rows[first + q] * j->ys + start;
            }
            expand_rows_bf16(b, n, o, r, vps, j->l.G, ys, nt);
        }
        start += o;
    }
}

typedef void (*step_fn)(const job *, int, walker *, int);

/* A phase's tiles, split over the threads in contiguous ranges (a thread's tiles of one column block run
 * back to back: its packed weights stay in L2); tile t carries the memory-bound steps [nrows t / tiles,
 * nrows (t + 1) / tiles), run after it, their bytes prefetched while it computes. Without tiles, the steps
 * are split. (Measured: tiles taken a few at a time from a shared counter were ~6% slower here.) */
static void phase(const job *j, int c0, int c1, const lora_args *l, step_fn step, walker *w) {
    const int tasks = tile_count(j, c0, c1), nth = omp_get_num_threads(), tid = omp_get_thread_num();
    if (tasks == 0) {
        for (int i = j->ngroups * tid / nth; i < j->ngroups * (tid + 1) / nth; i++) step(j, i, w, 0);
        return;
    }
    const int64_t rounds = (j->K / 2 + PF_EVERY - 1) / PF_EVERY;   /* walker calls in a tile */
    for (int task = tasks * tid / nth; task < tasks * (tid + 1) / nth; task++) {
        const int s0 = (int)((int64_t)j->ngroups * task / tasks), s1 = (int)((int64_t)j->ngroups * (task + 1) / tasks);
        walker_reset(w);
        for (int i = s0; i < s1; i++) step(j, i, w, 1);
        w->per_step = (int)((walker_lines(w) + rounds - 1) / rounds) + 1;
        run_tile(j, c0, c1, task, l, w);
        for (int i = s0; i < s1; i++) step(j, i, w, 0);
    }
}

/* Checks a call's LoRA shapes: 0, -1 odd K or R * G too large, -2 outputs that are not multiples of 16 or
 * do not add up to N (or G out of range). */
static int check_shapes(int K, int N, int R, int G, const int64_t *out) {
    if (K % 2 || R * G > MAX_ROWS) return -1;
    if (G < 1 || G > MAX_GROUPS) return -2;
    int64_t total = 0;
    for (int g = 0; g < G; g++) {
        if (out[g] % 16) return -2;
        total += out[g];
    }
    return total == N ? 0 : -2;
}

/* rows[0, n) = the rows t < M with slot[t] >= 0, in order; returns n, or -3 for a rank outside [0, R]. */
static int adapter_rows(const int64_t *slot, const int64_t *rank, int M, int R, int64_t *rows) {
    int n = 0;
    for (int t = 0; t < M; t++) {
        if (slot[t] < 0) continue;
        if (rank[t] < 0 || rank[t] > R) return -3;
        rows[n++] = t;
    }
    return n;
}

/* group[0, n] (returns n): rows[group[i], group[i + 1]) are consecutive rows of one slot and rank, at most
 * GROUP_ROWS (the engine orders a step's rows by adapter, so requests sharing one sit side by side) */
static int row_groups(const int64_t *rows, int nrows, const int64_t *slot, const int64_t *rank, int *group) {
    int n = 0;
    for (int i = 0; i < nrows; i++) {
        const int64_t t = rows[i];
        if (i == 0 || i - group[n - 1] >= GROUP_ROWS || slot[t] != slot[rows[i - 1]] || rank[t] != rank[rows[i - 1]])
            group[n++] = i;
    }
    group[n] = nrows;
    return n;
}

static job make_job(const uint16_t *x, int64_t xs, const uint16_t *p, uint16_t *y, int64_t ys, int M, int K, int N,
                    const int64_t *rows, int nrows, const int *group, int ngroups, const int64_t *slot, const int64_t *rank, const uint16_t *const *a, int G, const uint16_t *const *b,
                    const int64_t *out, uint32_t *vp, int64_t vp_stride) {
    job j = {x, p, y, xs, ys, M, K, N, (N + NB - 1) / NB, (M + MC - 1) / MC, 0, rows, nrows, group, ngroups, a,
             {slot, rank, vp, vp_stride, G, b, out}, vp, vp_stride, 0};
    j.mc = ((M + j.mblocks - 1) / j.mblocks + MR - 1) / MR * MR;
    /* phase 1 gets A's share of the adapters' bytes in columns (at least one block, when there are two) */
    const double a_share = (double)G * K / ((double)G * K + N);
    j.split = (int)(a_share * j.nblocks + 0.5);
    if (j.split < 1) j.split = j.nblocks > 1 ? 1 : 0;
    if (j.split >= j.nblocks) j.split = j.nblocks - 1;
    return j;
}

/* The two phases, run by every thread of the enclosing parallel region (w: the thread's own walker). The
 * caller waits for all threads (a barrier) before it reads y. */
static void gemm_lora_run(const job *j, walker *w) {
    phase(j, 0, j->split, 0, shrink_step, w);
#pragma omp barrier
    phase(j, j->split, j->nblocks, &j->l, expand_step, w);
}

/* x [M, K], y [M, N] (rows at strides xs, ys), p: packed W; slot, rank: [M] (slot -1: no adapter); a, b,
 * out as above; v: [M] rows of >= R * G fp32 at v_stride (scratch). 0, -1 odd K, -2 outputs that are not
 * multiples of 16 or do not add up to N, -3 a rank out of range, -4 out of memory. */
int gemm_lora_bf16(const uint16_t *x, int64_t xs, const uint16_t *p, uint16_t *y, int64_t ys, int M, int K, int N,
                   const int64_t *slot, const int64_t *rank, const uint16_t *const *a, int R, int G,
                   const uint16_t *const *b, const int64_t *out, uint32_t *vp,
                   int64_t vp_stride) {
    const int bad = check_shapes(K, N, R, G, out);
    if (bad) return bad;
    if (M <= 0) return 0;
    int64_t *rows = (int64_t *)malloc(sizeof(int64_t) * M);
    int *group = (int *)malloc(sizeof(int) * (M + 1));
    if (!rows || !group) { free(rows); free(group); return -4; }
    const int nrows = adapter_rows(slot, rank, M, R, rows);
    if (nrows < 0) { free(rows); free(group); return nrows; }
    if (nrows == 0) {                  /* no row with an adapter: the plain GEMM (as decoder.c's project) */
        free(rows);
        free(group);
#pragma omp parallel
        gemm_for(x, xs, p, y, ys, M, K, N);
        return 0;
    }
    const int ngroups = row_groups(rows, nrows, slot, rank, group);
    const job j = make_job(x, xs, p, y, ys, M, K, N, rows, nrows, group, ngroups, slot, rank, a, G, b,
                           out, vp, vp_stride);
    int failed = 0;
#pragma omp parallel
    {
        walker *w = (walker *)malloc(sizeof(walker));
        if (!w) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) gemm_lora_run(&j, w);
        free(w);
    }
    free(rows);
    free(group);
    return failed ? -4 : 0;
}
