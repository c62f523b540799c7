/* The AVX2 bf16 GEMM of one fused projection group with the multi-LoRA of its decode rows beside it, on
 * CPUs without AVX512-BF16 (gemm_avx2.c's tiles, lora_avx2.h's per-token steps):
 *     y = x @ W^T;   y[t, cols of output g] += Bt_g[s]^T (A[s] x[t])   for each row t with slot s = slot[t] >= 0
 * (rank r = rank[t]; A [R_s][G][K] rank-major, Bt_g [R_s][out_g] plain, pre-scaled: the LoRA slots as
 * lora_decode_bf16 reads them there). The bits are those of gemm_bf16_avx2 followed by lora_decode_bf16:
 * y rounded to bf16, then each row's delta (A x in fp32, each column's sum over ranks 0, 1, ... in order)
 * added and rounded once.
 *
 * A decode step's LoRA is memory-bound (each row its own adapter, read once), the GEMM compute-bound; here
 * the adapters' bytes stream into L2 by software prefetch while the tiles compute, and the memory-bound
 * steps run right after the tile that fetched them, from L2. The column blocks run in two phases:
 *   1. blocks [0, split): after each tile, its share of the shrinks v[t] = A[s] x[t];
 *   2. (barrier: every v and phase 1's columns done) blocks [split, nblocks): after each tile, its share of
 *      the expand of phase 1's columns;
 *   3. (barrier) the expand of phase 2's columns, row by row, each row's walk prefetching the next row's.
 * split leaves the fewest adapter bytes outside the tiles' shadow, a tile hiding HIDE bytes per
 * multiply-add (choose_split). (Expanding each phase 2 run of columns right after its tiles, which hides
 * every byte on paper, was slower on Zen 3: the many short (row, rank) pieces were not in L2 in time.)
 * Each thread runs a contiguous range of tasks; task q of a phase carries the rows [nrows q / tasks,
 * nrows (q + 1) / tasks) of that phase's steps. Every row is computed on its own: results never depend
 * on the rest of the batch.
 */
#include "loraplex_kernels.h"
#include "gemm_avx2.c"
#include "lora_avx2.h"
#include <omp.h>

#define MAX_GROUPS 3
#define MAX_RANK_ROWS (256 * MAX_GROUPS)
/* adapter bytes a tile hides per multiply-add of its own (measured on Zen 3 at bench_peft's shapes:
 * 0.1-0.25 about the same, 1 slower) */
#define HIDE 0.15

typedef struct {
    gemm_plan g;
    const uint16_t *x;         /* bf16 x (the shrinks split it themselves) */
    int64_t xs;
    const int64_t *rows;       /* the rows with an adapter, in order */
    int nrows;
    const int64_t *slot, *rank;
    const uint16_t *const *a;  /* [S] each slot's A */
    const uint16_t *const *b;  /* [S * G] each slot's Bt_g */
    const int64_t *out;
    int G;
    float *v;                  /* [M][v_stride] the shrinks' results */
    int64_t v_stride;
    int split;                 /* column blocks [0, split) are phase 1's */
} job;

typedef struct {               /* a thread's scratch */
    float *panel, *xsplit, *acc;
    walker w;
} scratch;

/* phase 1's shared step i: the shrink of row rows[i] (fetch: only queue its bytes on the walker) */
static void shrink_step(const job *j, int i, scratch *sc, int fetch) {
    const int64_t t = j->rows[i], s = j->slot[t];
    const int n = (int)j->rank[t] * j->G, K = j->g.K;
    if (fetch) { walker_add(&sc->w, j->a[s], (int64_t)n * K * 2); return; }
    split_row(j->x + t * j->xs, K, sc->xsplit);
    shrink_avx2(sc->xsplit, j->a[s], n, K, j->v + t * j->v_stride, 0);
}

/* row rows[i]'s expand over the columns [c0, c1) of y (fetch: only queue its bytes on the walker; pf: a
 * walker to step meanwhile, or NULL) */
static void expand_cols(const job *j, int i, int64_t c0, int64_t c1, scratch *sc, int fetch, walker *pf) {
    const int64_t t = j->rows[i], s = j->slot[t];
    const int r = (int)j->rank[t];
    int64_t col = 0;
    for (int g = 0; g < j->G; col += j->out[g], g++) {
        const int64_t o = j->out[g], lo = c0 > col ? c0 - col : 0, hi = c1 < col + o ? c1 - col : o;
        if (hi <= lo) continue;
        const uint16_t *bs = j->b[s * j->G + g] + lo;
        if (fetch) {
            for (int k = 0; k < r; k++) walker_add(&sc->w, bs + k * o, (hi - lo) * 2);
        } else {
            expand_rows(bs, o, hi - lo, r, j->v + t * j->v_stride + g, j->G, j->g.y + t * j->g.ys + col + lo,
                        sc->acc, pf);
        }
    }
}

static int64_t phase1_cols(const job *j) { return (int64_t)j->split * NC < j->g.N ? (int64_t)j->split * NC : j->g.N; }

/* phase 2's step i: row rows[i]'s expand over phase 1's columns */
static void expand_step(const job *j, int i, scratch *sc, int fetch) {
    expand_cols(j, i, 0, phase1_cols(j), sc, fetch, 0);
}

/* the walker steps expand_cols takes for row rows[i] over [c0, c1) */
static int64_t expand_cols_steps(const job *j, int i, int64_t c0, int64_t c1) {
    const int r = (int)j->rank[j->rows[i]];
    int64_t col = 0, n = 0;
    for (int g = 0; g < j->G; col += j->out[g], g++) {
        const int64_t lo = c0 > col ? c0 - col : 0, hi = c1 < col + j->out[g] ? c1 - col : j->out[g];
        if (hi > lo) n += expand_steps(hi - lo, r);
    }
    return n;
}

typedef void (*step_fn)(const job *, int, scratch *, int);

/* A phase's tasks (row block, column block in [c0, c1)), contiguous ranges per thread; task q runs its
 * tile with the bytes of its steps prefetched meanwhile, then the steps. Without tiles, the steps are
 * split over the threads. */
static void phase(const job *j, int c0, int c1, step_fn step, scratch *sc) {
    const int ncb = c1 - c0, tasks = j->g.mblocks * ncb, nth = omp_get_num_threads(), tid = omp_get_thread_num();
    if (tasks == 0) {
        for (int i = j->nrows * tid / nth; i < j->nrows * (tid + 1) / nth; i++) step(j, i, sc, 0);
        return;
    }
    for (int q = tasks * tid / nth; q < tasks * (tid + 1) / nth; q++) {
        const int task = q / ncb * j->g.nblocks + c0 + q % ncb;
        const int s0 = (int)((int64_t)j->nrows * q / tasks), s1 = (int)((int64_t)j->nrows * (q + 1) / tasks);
        walker_reset(&sc->w);
        for (int i = s0; i < s1; i++) step(j, i, sc, 1);
        sc->w.per_step = (int)(walker_lines(&sc->w) / task_steps(&j->g, task, sc->panel != 0)) + 1;
        gemm_task(&j->g, task, sc->panel, &sc->w);
        for (int i = s0; i < s1; i++) step(j, i, sc, 0);
    }
}

/* phase 3: the expand of phase 2's columns, rows split over the threads, each row's walk prefetching the
 * next row's bytes (as lora_decode_bf16 does) */
static void phase3(const job *j, scratch *sc) {
    const int nth = omp_get_num_threads(), tid = omp_get_thread_num();
    const int i0 = j->nrows * tid / nth, i1 = j->nrows * (tid + 1) / nth;
    const int64_t c0 = phase1_cols(j), c1 = j->g.N;
    for (int i = i0; i < i1 && c0 < c1; i++) {
        walker_reset(&sc->w);
        if (i + 1 < i1) expand_cols(j, i + 1, c0, c1, sc, 1, 0);
        sc->w.per_step = (int)(walker_lines(&sc->w) / (expand_cols_steps(j, i, c0, c1) + 1)) + 1;
        expand_cols(j, i, c0, c1, sc, 0, &sc->w);
    }
}

/* phase 1's column blocks: the split that leaves the fewest adapter bytes unhidden, a phase's tiles hiding
 * HIDE bytes per multiply-add (phase 1 the shrinks' A, phase 2 the expand of phase 1's columns; phase 3,
 * the rest of the expand, hides nothing) */
static int choose_split(const job *j) {
    double a_bytes = 0, b_bytes = 0;
    for (int i = 0; i < j->nrows; i++) {
        const double r = (double)j->rank[j->rows[i]];
        a_bytes += r * j->G * j->g.K * 2;
        b_bytes += r * j->g.N * 2;
    }
    const double hide = HIDE * j->g.M * NC * (double)j->g.K;   /* per column block */
    int best = 0;
    double best_left = a_bytes + b_bytes;
    for (int s = 1; s <= j->g.nblocks; s++) {
        const double share = (double)(s * NC < j->g.N ? s * NC : j->g.N) / j->g.N;
        double left = b_bytes * (1 - share);
        left += a_bytes > hide * s ? a_bytes - hide * s : 0;
        left += b_bytes * share > hide * (j->g.nblocks - s) ? b_bytes * share - hide * (j->g.nblocks - s) : 0;
        if (left < best_left) { best_left = left; best = s; }
    }
    return best;
}

/* 0, -1 odd K or R * G too large for v, -2 outputs that are not multiples of 16 or do not add up to N (or G
 * out of range), -3 a rank outside [0, R] (rows[0, *nrows) = the rows with a slot, in order) */
static int check_call(int K, int N, int R, int G, const int64_t *out, int64_t v_stride, const int64_t *slot,
                      const int64_t *rank, int M, int64_t *rows, int *nrows) {
    if (K % 2 || R * G > MAX_RANK_ROWS || R * G > v_stride) return -1;
    if (G < 1 || G > MAX_GROUPS) return -2;
    int64_t total = 0;
    for (int g = 0; g < G; g++) {
        if (out[g] % 16) return -2;
        total += out[g];
    }
    if (total != N) return -2;
    int n = 0;
    for (int t = 0; t < M; t++) {
        if (slot[t] < 0) continue;
        if (rank[t] < 0 || rank[t] > R) return -3;
        rows[n++] = t;
    }
    *nrows = n;
    return 0;
}

/* The three phases, every thread of the region (sc: its scratch). */
static void gemm_lora_run(const job *j, scratch *sc) {
    phase(j, 0, j->split, shrink_step, sc);
#pragma omp barrier
    phase(j, j->split, j->g.nblocks, expand_step, sc);
#pragma omp barrier
    phase3(j, sc);
}

/* x [M, K], y [M, N] (rows at strides xs, ys), p: packed W (gemm_avx2.c); slot, rank: [M] (slot -1: no
 * adapter); a, b, out as above; v: [M] rows of >= R * G fp32 at v_stride (scratch). 0, or check_call's
 * codes, or -4 out of memory. */
int gemm_lora_bf16_avx2(const uint16_t *x, int64_t xs, const uint16_t *p, uint16_t *y, int64_t ys, int M, int K,
                        int N, const int64_t *slot, const int64_t *rank, const uint16_t *const *a, int R, int G,
                        const uint16_t *const *b, const int64_t *out, float *v, int64_t v_stride) {
    if (M <= 0) return K % 2 ? -1 : 0;
    int64_t *rows = (int64_t *)malloc(sizeof(int64_t) * M);
    float *xf = (float *)malloc(sizeof(float) * (size_t)M * K);
    int nrows = 0, rc = rows && xf ? check_call(K, N, R, G, out, v_stride, slot, rank, M, rows, &nrows) : -4;
    if (rc) { free(rows); free(xf); return rc; }
    job j = {plan_gemm(xf, p, y, ys, M, K, N), x, xs, rows, nrows, slot, rank, a, b, out, G, v, v_stride, 0};
    j.split = choose_split(&j);
    int64_t max_out = 0;
    for (int i = 0; i < G; i++) max_out = out[i] > max_out ? out[i] : max_out;
#pragma omp parallel
    {
        scratch *sc = (scratch *)malloc(sizeof(scratch));
        float *buf = panel_alloc(K + (PADDED(K) + PADDED(max_out)) / NC);   /* the panel, then the rest */
        if (sc && buf) {
            sc->panel = M > MR ? buf : 0;
            sc->xsplit = buf + (size_t)K * NC;
            sc->acc = sc->xsplit + PADDED(K);
        } else {
#pragma omp atomic write
            rc = -4;
        }
        widen_rows_for(x, xs, xf, M, K);
#pragma omp barrier
        if (!rc) gemm_lora_run(&j, sc);
        free(buf);
        free(sc);
    }
    free(rows);
    free(xf);
    return rc;
}
