/* Multi-LoRA for tokens that are alone in their adapter slot (decode): for each listed token t,
 *     y[t, col_g : col_g + out_g] += Bt_g[s]^T (A[s] x[t])        for every fused output g,
 * where s = slot[t], r = rank[t] <= R, A[s] is [R, G, in] (rank-major: row (k, g) is rank k of output g) and
 * Bt_g[s] is [R, out_g] (already multiplied by the module's scale); only the first r ranks are read.
 *
 * x: rows of `in` values at stride x_stride; y: rows at stride y_stride, outputs side by side.
 * A and every Bt_g are addressed per slot: a[s], b[s * G + g].
 * Each adapter's weights are streamed once, front to back; the shrink keeps v in fp32 and the expand
 * accumulates a whole y row in fp32 before one rounding. Parallel over tokens with OpenMP.
 * Builds: fp32 and plain-C bf16 (DEFINE_LORA); bf16 with AVX512-BF16 (lora_avx512bf16.h) or with AVX2 + FMA
 * (lora_avx2.h), each also with lora_segments_bf16 for prefill tokens grouped by adapter (where AMX tiles
 * run, lora_amx.h, decode tokens too: the engine then calls only the segment kernel).
 */
#include "loraplex_kernels.h"
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "amx.h"
#include "bf16.h"
#include "sum16.h"

static inline void prefetch(const void *p, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch((const char *)p + i, 0, 3);
}

#define MAX_GROUPS 3
#define MAX_RANK_ROWS (256 * MAX_GROUPS)
#define MAX_IN 65536

#define DEFINE_LORA(NAME, T, LOAD, STORE)                                                                    \
int NAME(const T *x, int64_t x_stride, T *y, int64_t y_stride, const int64_t *tok, const int64_t *slot,       \
         const int64_t *rank, int n, const T *const *a, int R, int G, int in,                \
         const T *const *b, const int64_t *out) {                               \
    if (G > MAX_GROUPS || R * G > MAX_RANK_ROWS || in > MAX_IN) return -1;                                   \
    for (int i = 0; i < n; i++) if (rank[i] < 0 || rank[i] > R) return -3;                                   \
    int64_t width = 0;                                                                                        \
    for (int g = 0; g < G; g++) width += out[g];                                                             \
    int failed = 0;                                                                                           \
    _Pragma("omp parallel for schedule(static)")                                                              \
    for (int i = 0; i < n; i++) {                                                                             \
        const int64_t t = tok[i], s = slot[i];                                                                \
        const int r = (int)rank[i];                                                                           \
        float *buf = (float *)malloc(sizeof(float) * (in + width));                                          \
        if (!buf) { failed = 1; continue; }                                                                   \
        float *xf = buf, *acc = buf + in, v[MAX_RANK_ROWS];                                                  \
        const T *xt = x + t * x_stride;                                                                       \
        for (int j = 0; j < in; j++) xf[j] = LOAD(xt[j]);                                                     \
        const T *as = a[s];                                                                  \
        prefetch(as, 8 * in * sizeof(T));       /* the starts of A and of every B of this slot */            \
        for (int g = 0; g < G; g++) prefetch(b[s * G + g], 4 * out[g] * sizeof(T));           \
        int row = 0;                                                                                          \
        for (; row + 4 <= r * G; row += 4) {      /* four rows at a time: independent FMA chains */          \
            const T *a0 = as + (int64_t)row * in, *a1 = a0 + in, *a2 = a1 + in, *a3 = a2 + in;               \
            prefetch(a0 + 8 * in, 4 * in * sizeof(T));   /* 8 rows ahead: measured best here */               \
            float d0 = 0.f, d1 = 0.f, d2 = 0.f, d3 = 0.f;                                                     \
            _Pragma("omp simd reduction(+:d0,d1,d2,d3)")                                                      \
            for (int j = 0; j < in; j++) {                                                                    \
                const float xj = xf[j];                                                                       \
                d0 += LOAD(a0[j]) * xj; d1 += LOAD(a1[j]) * xj; d2 += LOAD(a2[j]) * xj; d3 += LOAD(a3[j]) * xj; \
            }                                                                                                 \
            v[row] = d0; v[row + 1] = d1; v[row + 2] = d2; v[row + 3] = d3;                                   \
        }                                                                                                     \
        for (; row < r * G; row++) {                                                                          \
            const T *ar = as + (int64_t)row * in;                                                             \
            float dot = 0.f;                                                                                  \
            _Pragma("omp simd reduction(+:dot)")                                                              \
            for (int j = 0; j < in; j++) dot += LOAD(ar[j]) * xf[j];                                          \
            v[row] = dot;                                                                                     \
        }                                                                                                     \
        T *yt = y + t * y_stride;                                                                             \
        for (int64_t j = 0; j < width; j++) acc[j] = 0.f;                                                     \
        int64_t col = 0;                                                                                      \
        for (int g = 0; g < G; g++) {                                                                         \
            const T *bs = b[s * G + g];                                                        \
            const int64_t o = out[g];                                                                         \
            float *ag = acc + col;                                                                            \
            int k = 0;                                                                                        \
            for (; k + 4 <= r; k += 4) {          /* four ranks per pass over the accumulator row */          \
                const float v0 = v[k * G + g], v1 = v[(k + 1) * G + g], v2 = v[(k + 2) * G + g],              \
                            v3 = v[(k + 3) * G + g];                                                          \
                const T *b0 = bs + (int64_t)k * o, *b1 = b0 + o, *b2 = b1 + o, *b3 = b2 + o;                  \
                prefetch(b0 + 8 * o, 4 * o * sizeof(T));                                                      \
                _Pragma("omp simd")                                                                           \
                for (int64_t j = 0; j < o; j++)                                                               \
                    ag[j] += v0 * LOAD(b0[j]) + v1 * LOAD(b1[j]) + v2 * LOAD(b2[j]) + v3 * LOAD(b3[j]);       \
            }                                                                                                 \
            for (; k < r; k++) {                                                                              \
                const float vk = v[k * G + g];                                                                \
                const T *bk = bs + (int64_t)k * o;                                                            \
                _Pragma("omp simd")                                                                           \
                for (int64_t j = 0; j < o; j++) ag[j] += vk * LOAD(bk[j]);                                    \
            }                                                                                                 \
            col += o;                                                                                         \
        }                                                                                                     \
        for (int64_t j = 0; j < width; j++) yt[j] = STORE(LOAD(yt[j]) + acc[j]);                              \
        free(buf);                                                                                            \
    }                                                                                                         \
    return failed ? -2 : 0;                                                                                   \
}

/* The tasks of a segment kernel: runs of up to tt tokens of one segment. On success (0) *task_seg holds
 * [tasks] segment indices followed by [tasks + 1] first tokens (free it); -3 a bad segment, -2 no memory. */
static __attribute__((unused)) int segment_tasks(const int64_t *seg_start, const int64_t *seg_rank, int n_seg, int R,
                                                 int tt, int64_t *tasks, int64_t **task_seg) {
    int64_t n = 0;
    for (int i = 0; i < n_seg; i++) {
        if (seg_rank[i] < 0 || seg_rank[i] > R || seg_start[i + 1] < seg_start[i]) return -3;
        n += (seg_start[i + 1] - seg_start[i] + tt - 1) / tt;
    }
    int64_t *ts = (int64_t *)malloc(sizeof(int64_t) * 2 * (n + 1));
    if (!ts) return -2;
    int64_t *first = ts + n + 1, k = 0;
    for (int i = 0; i < n_seg; i++)
        for (int64_t f = seg_start[i]; f < seg_start[i + 1]; f += tt) { ts[k] = i; first[k++] = f; }
    *tasks = n;
    *task_seg = ts;
    return 0;
}

DEFINE_LORA(lora_decode_f32, float, f32_id, f32_id)

#ifdef __AVX512BF16__
#include "lora_avx512bf16.h"
#include "lora_amx.h"

/* One token's delta, yt += Bt_g^T (A xt) over the G outputs side by side (as, bs: its adapter's A and Bt_g) */
static void token_bf16(const uint16_t *xt, uint16_t *yt, const uint16_t *as, int r, int G, int in,
                       const uint16_t *const *bs, const int64_t *out) {
    float v[MAX_RANK_ROWS];
    uint32_t vp[MAX_RANK_ROWS];
    prefetch(as, 8 * (int64_t)in * sizeof(uint16_t));   /* the first rows of A, the first chunks of B's rows */
    for (int g = 0; g < G; g++)
        for (int k = 0; k < r; k += 2) prefetch(bs[g] + k * out[g], 256);
    shrink_bf16(xt, as, r * G, in, v);
    pair_v(v, r, G, vp);
    for (int g = 0; g < G; g++) {
        expand_pairs_bf16(bs[g], out[g], out[g], r, vp + g, G, yt);
        yt += out[g];
    }
}

/* bf16 with AVX512-BF16: the same contract as above, except that each Bt_g[s] is in the paired layout of
 * lora_avx512bf16.h ([ceil(R / 2)][out_g][2]) and the intermediate A x is rounded to bf16 before the expand (as
 * a bf16 LoRA does); ~3x fewer instructions per weight byte. */
int lora_decode_bf16(const uint16_t *x, int64_t x_stride, uint16_t *y, int64_t y_stride, const int64_t *tok,
                     const int64_t *slot, const int64_t *rank, int n, const uint16_t *const *a,
                     int R, int G, int in, const uint16_t *const *b,
                     const int64_t *out) {
    if (G > MAX_GROUPS || R * G > MAX_RANK_ROWS || in > MAX_IN) return -1;
    for (int i = 0; i < n; i++) if (rank[i] < 0 || rank[i] > R) return -3;
#pragma omp parallel for schedule(static)
    for (int i = 0; i < n; i++)
        token_bf16(x + tok[i] * x_stride, y + tok[i] * y_stride, a[slot[i]], (int)rank[i], G, in, b + slot[i] * G, out);
    return 0;
}

/* Multi-LoRA for segments of tokens sharing an adapter (prefill), bf16: the same per-token result as
 * y[t] += Bt[s]^T (A[s] x[t]) with each token computed on its own (no sums across tokens, so a token's
 * delta does not depend on the rest of the batch), 4 tokens at a time so that each weight vector loaded
 * serves 4 tokens: shrink in 4 tokens x 4 rows dot-product tiles (vdpbf16ps, reduced 16 at a time),
 * expand in 4 tokens x 32 columns register tiles (vdpbf16ps over the paired B layout); the arguments
 * are lora_segments_bf16's (at the end of this file). */
#define TT GROUP_ROWS   /* tokens a tile (lora_avx512bf16.h: shrink_rows_bf16 takes that many) */


/* Tokens [first, first + nt) of segment i on vdpbf16ps, TT at a time (a token alone: the decode kernel's
 * loop, the same bits without a padded tile). */
static void segment_tiles(const uint16_t *x, int64_t x_stride, uint16_t *y, int64_t y_stride, const int64_t *tok,
                          int64_t first, int n, const uint16_t *as, const uint16_t *const *bs, int r, int G, int in,
                          const int64_t *out) {
    for (int64_t f = first; f < first + n; f += TT) {
        const int nt = (int)(first + n - f < TT ? first + n - f : TT);
        if (nt == 1) {
            token_bf16(x + tok[f] * x_stride, y + tok[f] * y_stride, as, r, G, in, bs, out);
            continue;
        }
        const uint16_t *xs[TT];
        uint16_t *ys[TT];
        for (int tt = 0; tt < TT; tt++) {
            const int64_t t = tok[f + (tt < nt ? tt : nt - 1)];
            xs[tt] = x + t * x_stride;
            ys[tt] = y + t * y_stride;
        }
        float v[TT][MAX_RANK_ROWS];
        uint32_t vp[TT][MAX_RANK_ROWS];
        float *vs[TT] = {v[0], v[1], v[2], v[3]};
        shrink_rows_bf16(xs, TT, as, r * G, in, vs);   /* (x rows past the real tokens repeat one) */
        for (int tt = 0; tt < TT; tt++) pair_v(v[tt], r, G, vp[tt]);
        int64_t col = 0;
        for (int g = 0; g < G; g++) {
            uint16_t *yg[TT];
            for (int tt = 0; tt < TT; tt++) yg[tt] = ys[tt] + col;
            const uint32_t *vps[TT];
            for (int tt = 0; tt < TT; tt++) vps[tt] = vp[tt] + g;
            expand_rows_bf16(bs[g], out[g], out[g], r, vps, G, yg, nt);
            col += out[g];
        }
    }
}

/* Tokens per segment task: AT (16) where AMX tiles run, else TT (segment_tasks' tt) */
static int segment_task_tokens(void) {
#if GEMM_AMX
    if (amx_on) return AT;
#endif
    return TT;
}

/* The body of lora_segments_bf16 over segment_tasks' tasks (of up to segment_task_tokens() tokens): a
 * work-shared loop (decoder.c runs it inside its own parallel region). On AMX (lora_amx.h) where the
 * group's shapes fit, else on vdpbf16ps tiles; whichever runs, it runs every token of the call. */
static void segments_for(const uint16_t *x, int64_t x_stride, uint16_t *y, int64_t y_stride, const int64_t *tok,
                         const int64_t *seg_start, const int64_t *seg_slot, const int64_t *seg_rank,
                         const uint16_t *const *a, int G, int in, const uint16_t *const *b, const int64_t *out, int64_t tasks, const int64_t *task_seg) {
    const int64_t *task_first = task_seg + tasks + 1;
    const int tt = segment_task_tokens();
#if GEMM_AMX
    const int on_amx = amx_on && amx_lora_fits(in, G, out);
    uint32_t *xp = on_amx ? (uint32_t *)aligned_alloc(64, (size_t)in * AT * 2) : NULL;
    float *vt = on_amx ? (float *)malloc(sizeof(float) * MAX_RANK_ROWS * AT) : NULL;
    int filled = AT;        /* xp's columns that may be non-zero */
#endif
#if GEMM_AMX
    if (on_amx) {       /* this thread's static share of the tasks, the next one's bytes prefetched meanwhile */
        const int nth = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t lo = tasks * me / nth, hi = tasks * (me + 1) / nth;
        walker *pf = (walker *)malloc(sizeof(walker));
        for (int64_t task = lo; task < hi; task++) {
            const int64_t i = task_seg[task], first = task_first[task];
            const int nt = (int)(seg_start[i + 1] - first < tt ? seg_start[i + 1] - first : tt);
            const int64_t s = seg_slot[i];
            const int r = (int)seg_rank[i];
            if (!xp || !vt) {
                segment_tiles(x, x_stride, y, y_stride, tok, first, nt, a[s], b + s * G, r, G, in, out);
                continue;
            }
            const uint16_t *xs[AT];
            uint16_t *ys[AT];
            for (int t = 0; t < nt; t++) {
                xs[t] = x + tok[first + t] * x_stride;
                ys[t] = y + tok[first + t] * y_stride;
            }
            walker *w = NULL;
            if (pf && task + 1 < hi && seg_slot[task_seg[task + 1]] != s) {
                const int64_t s2 = seg_slot[task_seg[task + 1]];
                walk_task(pf, a[s2], (int)seg_rank[task_seg[task + 1]], G, in, b + s2 * G, out,
                          task_amx_steps(r, G, in, out));
                w = pf;
            }
            task_amx(xs, ys, nt, a[s], b + s * G, r, G, in, out, xp, &filled, vt, w);
        }
        free(pf);
        free(xp);
        free(vt);
#pragma omp barrier
        return;
    }
#endif
#pragma omp for schedule(static)
    for (int64_t task = 0; task < tasks; task++) {
        const int64_t i = task_seg[task], first = task_first[task];
        const int nt = (int)(seg_start[i + 1] - first < tt ? seg_start[i + 1] - first : tt);
        const int64_t s = seg_slot[i];
        const int r = (int)seg_rank[i];
        segment_tiles(x, x_stride, y, y_stride, tok, first, nt, a[s], b + s * G, r, G, in, out);
    }
#if GEMM_AMX
    free(xp);
    free(vt);
#endif
}

/* lora_segments_bf16's tasks (see segment_tasks) in a parallel region of their own: 0 */
static int segments_run(const uint16_t *x, int64_t x_stride, uint16_t *y, int64_t y_stride, const int64_t *tok,
                        const int64_t *seg_start, const int64_t *seg_slot, const int64_t *seg_rank,
                        const uint16_t *const *a, int G, int in, const uint16_t *const *b, const int64_t *out, int64_t tasks, const int64_t *task_seg) {
#pragma omp parallel
    segments_for(x, x_stride, y, y_stride, tok, seg_start, seg_slot, seg_rank, a, G, in, b, out, tasks, task_seg);
    return 0;
}
#elif defined(__AVX2__) && defined(__FMA__)
#include "lora_avx2.h"

/* token i of a thread's run [.., end): its delta, prefetching token i + 1's adapter meanwhile (pf may be NULL) */
static void lora_tokens_step(const uint16_t *x, int64_t x_stride, uint16_t *y, int64_t y_stride, const int64_t *tok,
                             const int64_t *slot, const int64_t *rank, int i, int end, const uint16_t *const *a, int G, int in, const uint16_t *const *b,
                             const int64_t *out, float *xs, float *v, float *acc, walker *pf) {
    const uint16_t *bg[MAX_GROUPS], *bn[MAX_GROUPS];
    const int64_t t = tok[i], s = slot[i];
    const int r = (int)rank[i];
    for (int g = 0; g < G; g++) bg[g] = b[s * G + g];
    if (pf && i + 1 < end && slot[i + 1] != s) {
        for (int g = 0; g < G; g++) bn[g] = b[slot[i + 1] * G + g];
        walk_token(pf, a[slot[i + 1]], (int)rank[i + 1], G, in, bn, out, token_steps(r, G, in, out));
    } else if (pf) {
        walker_reset(pf);
    }
    split_row(x + t * x_stride, in, xs);
    lora_token_avx2(xs, y + t * y_stride, a[s], r, G, in, bg, out, v, acc, pf);
}

/* bf16 on AVX2 + FMA: the contract of DEFINE_LORA (B plain, the intermediate A x in fp32), computed by
 * lora_avx2.h in its fixed per-token order: the same bits as the segment kernel below. Each B is read
 * row after row (expand_rows: measured on Zen 3, 64 adapters of ranks 8-32 from memory, gate_up's LoRA
 * 0.95 -> 0.73 ms a layer, bench_peft uniform ~146 -> ~156 tok/s). */
int lora_decode_bf16(const uint16_t *x, int64_t x_stride, uint16_t *y, int64_t y_stride, const int64_t *tok,
                     const int64_t *slot, const int64_t *rank, int n, const uint16_t *const *a,
                     int R, int G, int in, const uint16_t *const *b,
                     const int64_t *out) {
    if (G > MAX_GROUPS || R * G > MAX_RANK_ROWS || in > MAX_IN) return -1;
    for (int i = 0; i < n; i++) if (rank[i] < 0 || rank[i] > R) return -3;
    int failed = 0;
#pragma omp parallel
    {
        int64_t widest = 0;
        for (int g = 0; g < G; g++) widest = out[g] > widest ? out[g] : widest;
        float *xs = (float *)malloc(sizeof(float) * PADDED(in)), v[MAX_RANK_ROWS];
        float *acc = (float *)malloc(sizeof(float) * PADDED(widest));
        walker *pf = (walker *)malloc(sizeof(walker));
        if (!xs || !acc) {
#pragma omp atomic write
            failed = 1;
        }
        const int nth = omp_get_num_threads(), tid = omp_get_thread_num();
        for (int i = n * tid / nth; i < n * (tid + 1) / nth && xs && acc; i++)
            lora_tokens_step(x, x_stride, y, y_stride, tok, slot, rank, i, n * (tid + 1) / nth, a, G, in,
                             b, out, xs, v, acc, pf);
        free(xs);
        free(acc);
        free(pf);
    }
    return failed ? -2 : 0;
}

static int segment_task_tokens(void) { return TT; }   /* tokens per segment task (no AMX here) */

/* Segments of tokens sharing an adapter (prefill), bf16 on AVX2 + FMA: lora_segments_bf16's tasks (B
 * plain). Each task is up to TT tokens of one segment: its shrink runs 4 tokens x 2 rows per pass
 * (dot4x2; a task's last tokens 8 (token, row) pairs per dot8), so each A line loaded serves all its
 * tokens; its expand reads each B line once for all its tokens. Every token's result is the bits
 * lora_decode_bf16 gives it. Measured here: ~60 GFLOP/s, 1.5x the per-token kernel on the same tokens.
 * 0, or -2 when a thread's scratch could not be allocated. */
static int segments_run(const uint16_t *x, int64_t x_stride, uint16_t *y, int64_t y_stride, const int64_t *tok,
                        const int64_t *seg_start, const int64_t *seg_slot, const int64_t *seg_rank,
                        const uint16_t *const *a, int G, int in, const uint16_t *const *b, const int64_t *out, int64_t tasks, const int64_t *task_seg) {
    const int64_t *task_first = task_seg + tasks + 1;
    int failed = 0;
#pragma omp parallel
    {
        float *xs = (float *)malloc(sizeof(float) * TT * PADDED(in));
        float *v = (float *)malloc(sizeof(float) * TT * MAX_RANK_ROWS);
        if (!xs || !v) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t task = 0; task < tasks; task++) {
            if (!xs || !v) continue;
            const int64_t i = task_seg[task], first = task_first[task], s = seg_slot[i];
            const int nt = (int)(seg_start[i + 1] - first < TT ? seg_start[i + 1] - first : TT);
            const int r = (int)seg_rank[i], rows = r * G;
            const uint16_t *as = a[s];
            uint16_t *ys[TT];
            for (int t = 0; t < nt; t++) {
                split_row(x + tok[first + t] * x_stride, in, xs + t * PADDED(in));
                ys[t] = y + tok[first + t] * y_stride;
            }
            if (nt == TT) {   /* shrink: 4 tokens x 2 rows per pass */
                const float *xt[TT] = {xs, xs + PADDED(in), xs + 2 * PADDED(in), xs + 3 * PADDED(in)};
                for (int row = 0; row < rows; row += 2) {
                    float dots[8];
                    const uint16_t *a0 = as + (int64_t)row * in, *a1 = row + 1 < rows ? a0 + in : a0;
                    dot4x2(a0, a1, xt, in, dots);
                    for (int t = 0; t < TT; t++) {
                        v[t * MAX_RANK_ROWS + row] = dots[2 * t];
                        if (row + 1 < rows) v[t * MAX_RANK_ROWS + row + 1] = dots[2 * t + 1];
                    }
                }
            }
            /* (a task's last tokens) pair p = (row p / nt, token p % nt), 8 pairs per dot8 */
            for (int p0 = 0; nt < TT && p0 < rows * nt; p0 += 8) {
                const uint16_t *ar[8];
                const float *xq[8];
                float dots[8];
                for (int q = 0; q < 8; q++) {
                    const int p = p0 + q < rows * nt ? p0 + q : rows * nt - 1;
                    ar[q] = as + (int64_t)(p / nt) * in;
                    xq[q] = xs + (p % nt) * PADDED(in);
                }
                dot8(ar, xq, in, dots, 0);
                for (int q = 0; q < 8 && p0 + q < rows * nt; q++)
                    v[(p0 + q) % nt * MAX_RANK_ROWS + (p0 + q) / nt] = dots[q];
            }
            int64_t col = 0;
            for (int g = 0; g < G; g++) {
                const float *vg[TT];
                uint16_t *yg[TT];
                for (int t = 0; t < nt; t++) { vg[t] = v + t * MAX_RANK_ROWS + g; yg[t] = ys[t] + col; }
                expand_avx2(b[s * G + g], out[g], r, vg, G, yg, nt);
                col += out[g];
            }
        }
        free(xs);
        free(v);
    }
    return failed ? -2 : 0;
}
#else
DEFINE_LORA(lora_decode_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
#endif

#if defined(__AVX512BF16__) || (defined(__AVX2__) && defined(__FMA__))
/* Multi-LoRA for segments of tokens sharing an adapter (prefill; on AMX every token), bf16 (this CPU's
 * segments_for / segments_run above).
 * Segment i covers tok[seg_start[i] .. seg_start[i + 1]) (rows of x and y), adapter slot seg_slot[i],
 * rank seg_rank[i] <= R; other arguments as lora_decode_bf16. 0; -1 shapes past the compiled limits;
 * -3 a bad segment; -2 out of memory. */
int lora_segments_bf16(const uint16_t *x, int64_t x_stride, uint16_t *y, int64_t y_stride, const int64_t *tok,
                       const int64_t *seg_start, const int64_t *seg_slot, const int64_t *seg_rank, int n_seg,
                       const uint16_t *const *a, int R, int G, int in, const uint16_t *const *b, const int64_t *out) {
    if (G > MAX_GROUPS || R * G > MAX_RANK_ROWS || in > MAX_IN) return -1;
    int64_t tasks = 0, *task_seg = NULL;
    const int rc = segment_tasks(seg_start, seg_rank, n_seg, R, segment_task_tokens(), &tasks, &task_seg);
    if (rc) return rc;
    const int ran = segments_run(x, x_stride, y, y_stride, tok, seg_start, seg_slot, seg_rank, a, G,
                                 in, b, out, tasks, task_seg);
    free(task_seg);
    return ran;
}
#endif
