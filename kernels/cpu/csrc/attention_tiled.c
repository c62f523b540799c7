/* Paged attention for CPU over tiles of query rows: every token of a step is a query row over its own
 * prefix, and the rows of one request are taken a tile at a time, as small matrix products. The contract
 * of kernels/triton/paged_attention.py:
 *
 * q, out:   [R, H, d]                          (bf16 or fp32, contiguous)
 * k:        page p holds a block keys-last, [KVH, d, bs] (contiguous), at k + p * page_stride
 * v:        page p holds a block in rows, [bs, KVH, d] (contiguous), at v + p * page_stride
 * tables:   [S, max_blocks] int32 page ids of each request
 * tiles:    [N, 4] int32 (request s, first row r0, rows n, length l0): row r0 + i attends to the first
 *           l0 + i tokens of request s. The tiles cover every row once; n >= 1, l0 >= 1.
 * window:   > 0: a row of length L attends to its last `window` tokens only, [L - window, L) (a sliding
 *           window; blocks before every row's window are not read); 0: to all.
 * softcap:  > 0: each score s becomes softcap * tanh(s / softcap) before the softmax (Gemma 2).
 *
 * A tile's query vectors (rows x heads) sharing a KV head are taken 4 at a time. Per K/V block: K widened
 * to fp32 as stored, keys last ([KVH, d, 16-key chunks]; the cache keeps K that way so that no transpose
 * is needed here), so 4 queries x 16 keys of scores are 8 accumulators fed
 * by one broadcast per query and two loads per dimension; then, after a softmax over each row's own
 * length (probabilities past it are 0), P.V as 4 queries x 16 dims accumulated over the block's keys.
 * Every query's arithmetic is the same whatever shares its tile (its own accumulators, keys and dims in
 * the same order; a key past its length adds 0 x v), so a token gets the same bits as a decode row (a
 * tile of one) and as a prefill row. fp32 inside; bf16 output rounded to nearest even. d must be a
 * multiple of 16 for the blocked path (else the plain loops). Parallel over tiles with OpenMP.
 */
#include "loraplex_kernels.h"
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define MAX_HEADS 128
#define MAX_DIM 256
#define MAX_BLOCK 256
#define MAX_SPLITS 1024   /* splits of one row's keys: 1,024 x split_blocks x block_size tokens */

typedef float v8 __attribute__((vector_size(32)));

static inline v8 bcast(float x) { return (v8){x, x, x, x, x, x, x, x}; }
static inline v8 load8(const float *p) { v8 r; memcpy(&r, p, sizeof r); return r; }
static inline void store8(float *p, v8 x) { memcpy(p, &x, sizeof x); }

/* scores of 4 queries (q[r], d floats, scaled) against 16 keys at kt (dims x 16 keys, row stride ks):
 * out[r][t] = q[r] . key t, for t < nt */
static inline void scores_4x16(const float *const q[4], const float *kt, int64_t ks, int d, float *out[4],
                               int nt) {
    v8 a[4][2] = {{{0}}};
    for (int x = 0; x < d; x++) {
        const v8 k0 = load8(kt + x * ks), k1 = load8(kt + x * ks + 8);
        for (int r = 0; r < 4; r++) {
            const v8 qb = bcast(q[r][x]);
            a[r][0] += qb * k0;
            a[r][1] += qb * k1;
        }
    }
    for (int r = 0; r < 4; r++) {
        float tmp[16];
        store8(tmp, a[r][0]);
        store8(tmp + 8, a[r][1]);
        memcpy(out[r], tmp, sizeof(float) * nt);
    }
}

/* acc[r][0..16) += sum over t < nt of p[r][t] * v[t][0..16) (v rows at stride vs) */
static inline void pv_4x16(float *const acc[4], const float *const p[4], const float *v, int64_t vs, int nt) {
    v8 a[4][2];
    for (int r = 0; r < 4; r++) { a[r][0] = load8(acc[r]); a[r][1] = load8(acc[r] + 8); }
    for (int t = 0; t < nt; t++) {
        const v8 v0 = load8(v + t * vs), v1 = load8(v + t * vs + 8);
        for (int r = 0; r < 4; r++) {
            const v8 pb = bcast(p[r][t]);
            a[r][0] += pb * v0;
            a[r][1] += pb * v1;
        }
    }
    for (int r = 0; r < 4; r++) { store8(acc[r], a[r][0]); store8(acc[r] + 8, a[r][1]); }
}

/* One tile over one split of its keys, [k0, k0 + L), in fp32: qf [n, H, d] scaled queries; kt, vf:
 * widening buffers; score [n, H, L]; out: acc [n, H, d] (unnormalised), mx and sum [n, H] (each query's
 * max score in the split and its sum of exp(score - max)). Row i attends to keys [0, l0 + i). */
typedef struct {
    const float *qf;
    float *acc, *mx, *sum, *score, *kt, *vf;
    int n, H, KVH, d, bs;
    int64_t l0, k0, L, window;
    float cap;
} Tile;

/* how many of the split's keys row i attends to */
static inline int64_t local_len(const Tile *T, int i) {
    const int64_t len = T->l0 + i - T->k0;
    return len < 0 ? 0 : len > T->L ? T->L : len;
}

/* the first of the split's keys row i attends to (its sliding window's start; 0 without one) */
static inline int64_t local_lo(const Tile *T, int i) {
    if (T->window <= 0) return 0;
    const int64_t lo = T->l0 + i - T->window - T->k0;
    return lo < 0 ? 0 : lo > T->L ? T->L : lo;
}

/* the query vectors of KV head h, 4 at a time (the last group padded with its first, results unused) */
static inline int group(const Tile *T, int h, int first, int idx[4]) {
    const int G = T->H / T->KVH, count = T->n * G;
    int m = 0;
    for (; m < 4 && first + m < count; m++) {
        const int i = (first + m) / G, g = (first + m) % G;
        idx[m] = i * T->H + h * G + g;
    }
    for (int r = m; r < 4; r++) idx[r] = idx[0];
    return m;
}

static void block_scores(const Tile *T, int64_t b, int nb) {
    const int G = T->H / T->KVH, d = T->d, chunks = (nb + 15) / 16;
    const int64_t ks = (int64_t)chunks * 16;
    for (int h = 0; h < T->KVH; h++)
        for (int first = 0; first < T->n * G; first += 4) {
            int idx[4];
            group(T, h, first, idx);
            const float *q[4];
            float *out[4], junk[4][16] = {{0}};
            for (int c = 0; c < chunks; c++) {
                const int nt = nb - c * 16 < 16 ? nb - c * 16 : 16;
                for (int r = 0; r < 4; r++) {
                    q[r] = T->qf + (int64_t)idx[r] * d;
                    out[r] = first + r < T->n * G ? T->score + (int64_t)idx[r] * T->L + b * T->bs + c * 16
                                                : junk[r];
                }
                scores_4x16(q, T->kt + (int64_t)h * d * ks + c * 16, ks, d, out, nt);
            }
        }
}

static void block_pv(const Tile *T, int64_t b, int nb) {
    const int G = T->H / T->KVH, d = T->d, row = T->KVH * d;
    float junk[4][16] = {{0}};
    for (int h = 0; h < T->KVH; h++)
        for (int first = 0; first < T->n * G; first += 4) {
            int idx[4];
            const int m = group(T, h, first, idx);
            const float *p[4];
            float *acc[4];
            for (int c = 0; c < d; c += 16) {
                for (int r = 0; r < 4; r++) {
                    p[r] = T->score + (int64_t)idx[r] * T->L + b * T->bs;
                    acc[r] = r < m ? T->acc + (int64_t)idx[r] * d + c : junk[r];
                }
                pv_4x16(acc, p, T->vf + (int64_t)h * d + c, row, nb);
            }
        }
}

/* scores -> exp(score - the row's max in the split) over the row's keys in the split; 0 outside them */
static void softmax_rows(const Tile *T) {
    for (int i = 0; i < T->n; i++) {
        const int64_t len = local_len(T, i), lo = local_lo(T, i);
        for (int j = 0; j < T->H; j++) {
            const int64_t q = (int64_t)i * T->H + j;
            float *s = T->score + q * T->L, m = -FLT_MAX, total = 0.f;
            if (T->cap > 0.f)
                for (int64_t t = lo; t < len; t++) s[t] = T->cap * tanhf(s[t] / T->cap);
            for (int64_t t = lo; t < len; t++) m = s[t] > m ? s[t] : m;
            for (int64_t t = 0; t < lo && t < len; t++) s[t] = 0.f;
            for (int64_t t = lo; t < len; t++) { s[t] = expf(s[t] - m); total += s[t]; }
            for (int64_t t = len; t < T->L; t++) s[t] = 0.f;
            T->mx[q] = m;
            T->sum[q] = total;
        }
    }
}

/* row i of a tile from its splits' partials (part[s] for split s, the tile's n rows each): out = the
 * sum over the row's splits of acc_s exp(mx_s - M) over the same sum of sum_s exp(mx_s - M), in split
 * order; one split gives acc_0 / sum_0. A row's splits depend on its length alone. */
static void merge_row(float *const *acc, float *const *mx, float *const *sum, int nsplit, int64_t q, int d,
                      float *out) {
    float m = -FLT_MAX, total = 0.f;
    for (int s = 0; s < nsplit; s++) m = mx[s][q] > m ? mx[s][q] : m;
    for (int x = 0; x < d; x++) out[x] = 0.f;
    for (int s = 0; s < nsplit; s++) {
        const float w = expf(mx[s][q] - m);
        total += sum[s][q] * w;
        for (int x = 0; x < d; x++) out[x] += acc[s][q * d + x] * w;
    }
    for (int x = 0; x < d; x++) out[x] /= total;
}

/* the plain loops (d not a multiple of 16): same results up to rounding, no blocking */
static void plain_block_scores(const Tile *T, int64_t b, int nb) {
    const int G = T->H / T->KVH, d = T->d;
    const int64_t ks = (int64_t)((nb + 15) / 16) * 16;
    for (int i = 0; i < T->n; i++)
        for (int j = 0; j < T->H; j++) {
            const float *qh = T->qf + ((int64_t)i * T->H + j) * d, *kh = T->kt + (int64_t)(j / G) * d * ks;
            float *dst = T->score + ((int64_t)i * T->H + j) * T->L + b * T->bs;
            for (int t = 0; t < nb; t++) {
                float dot = 0.f;
                for (int x = 0; x < d; x++) dot += qh[x] * kh[(int64_t)x * ks + t];
                dst[t] = dot;
            }
        }
}

static void plain_block_pv(const Tile *T, int64_t b, int nb) {
    const int G = T->H / T->KVH, d = T->d, row = T->KVH * d;
    for (int i = 0; i < T->n; i++)
        for (int j = 0; j < T->H; j++) {
            const float *p = T->score + ((int64_t)i * T->H + j) * T->L + b * T->bs;
            float *aj = T->acc + ((int64_t)i * T->H + j) * d;
            for (int t = 0; t < nb; t++)
                for (int x = 0; x < d; x++) aj[x] += p[t] * T->vf[(int64_t)t * row + (j / G) * d + x];
        }
}

/* A split of a tile: its partials live at part + offset (acc [n, H, d], then mx and sum [n, H]). */
typedef struct { int tile, split; int64_t offset; } Task;

#define DEFINE_TILED(NAME, TYPE, LOAD, STORE)                                                                 \
static int NAME##_split(const TYPE *q, const TYPE *k, const TYPE *v, int64_t page_stride, const int32_t *table,\
                        int r0, int n, int l0, int64_t k0, int64_t span, int H, int KVH, int d, int bs,       \
                        float scale, int64_t window, float cap, float *part) {                                \
    const int row = KVH * d, blocked = d % 16 == 0;                                                           \
    const int64_t nblocks = (span + bs - 1) / bs, hd = (int64_t)H * d, ks = (int64_t)((bs + 15) / 16) * 16;  \
    float *buf = (float *)malloc(sizeof(float) * (n * hd + (int64_t)n * H * span + (int64_t)row * (ks + bs)));\
    if (!buf) return 1;                                                                                       \
    Tile T = {buf, part, part + n * hd, part + n * hd + (int64_t)n * H, buf + n * hd,                          \
              buf + n * hd + (int64_t)n * H * span, buf + n * hd + (int64_t)n * H * span + (int64_t)row * ks,  \
              n, H, KVH, d, bs, l0, k0, span, window, cap};                                                   \
    for (int64_t e = 0; e < n * hd; e++) { buf[e] = LOAD(q[(int64_t)r0 * hd + e]) * scale; T.acc[e] = 0.f; }  \
    const int64_t b0 = local_lo(&T, 0) / bs;           /* blocks before row 0's window: no row reads them */ \
    for (int64_t b = b0; b < nblocks; b++) {                                                                  \
        const TYPE *kb = k + (int64_t)table[k0 / bs + b] * page_stride;                                       \
        const int nb = (int)(span - b * bs < bs ? span - b * bs : bs), kc = (nb + 15) / 16 * 16;             \
        for (int e = 0; e < row; e++) {                                                                       \
            float *dst = T.kt + (int64_t)e * kc;                                                              \
            for (int t = 0; t < nb; t++) dst[t] = LOAD(kb[(int64_t)e * bs + t]);                              \
            for (int t = nb; t < kc; t++) dst[t] = 0.f;                                                       \
        }                                                                                                     \
        if (blocked) block_scores(&T, b, nb); else plain_block_scores(&T, b, nb);                             \
    }                                                                                                         \
    softmax_rows(&T);                                                                                         \
    for (int64_t b = b0; b < nblocks; b++) {                                                                  \
        const TYPE *vb = v + (int64_t)table[k0 / bs + b] * page_stride;                                       \
        const int nb = (int)(span - b * bs < bs ? span - b * bs : bs);                                        \
        for (int64_t e = 0; e < (int64_t)nb * row; e++) T.vf[e] = LOAD(vb[e]);                                \
        if (blocked) block_pv(&T, b, nb); else plain_block_pv(&T, b, nb);                                     \
    }                                                                                                         \
    free(buf);                                                                                                \
    return 0;                                                                                                 \
}                                                                                                             \
                                                                                                              \
int NAME(const TYPE *q, TYPE *out, const TYPE *k, const TYPE *v, int64_t page_stride, const int32_t *tables, \
         int64_t max_blocks, const int32_t *tiles, int num_tiles, int H, int KVH, int d, int bs, float scale,  \
         int split_blocks, int64_t window, float softcap) {                                                   \
    if (H > MAX_HEADS || d > MAX_DIM || bs > MAX_BLOCK || H % KVH || split_blocks < 1) return -1;             \
    const int64_t S = (int64_t)split_blocks * bs, hd = (int64_t)H * d;                                       \
    int64_t ntasks = 0, words = 0;                                                                            \
    for (int i = 0; i < num_tiles; i++) ntasks += ((int64_t)tiles[4 * i + 3] + tiles[4 * i + 2] - 1 + S - 1) / S; \
    Task *tasks = (Task *)malloc(sizeof(Task) * (ntasks + 1));                                                \
    int64_t *first = (int64_t *)malloc(sizeof(int64_t) * (num_tiles + 1));                                   \
    if (!tasks || !first) { free(tasks); free(first); return -2; }                                           \
    for (int i = 0, t = 0; i < num_tiles; i++) {                                                              \
        const int n = tiles[4 * i + 2];                                                                       \
        const int64_t L = (int64_t)tiles[4 * i + 3] + n - 1;                                                 \
        first[i] = t;                                                                                         \
        for (int64_t s = 0; s * S < L; s++, t++) {                                                            \
            tasks[t] = (Task){i, (int)s, words};                                                              \
            words += n * (hd + 2 * H);                                                                        \
        }                                                                                                     \
    }                                                                                                         \
    first[num_tiles] = ntasks;                                                                                \
    float *part = (float *)malloc(sizeof(float) * (words + 1));                                               \
    if (!part) { free(tasks); free(first); return -2; }                                                       \
    int failed = 0;                                                                                           \
    _Pragma("omp parallel for schedule(dynamic, 1)")                                                          \
    for (int64_t t = 0; t < ntasks; t++) {                                                                    \
        const int32_t *tile = tiles + 4 * (int64_t)tasks[t].tile;                                             \
        const int64_t L = (int64_t)tile[3] + tile[2] - 1, k0 = (int64_t)tasks[t].split * S;                  \
        if (NAME##_split(q, k, v, page_stride, tables + (int64_t)tile[0] * max_blocks, tile[1], tile[2], tile[3], \
                         k0, L - k0 < S ? L - k0 : S, H, KVH, d, bs, scale, window, softcap,                  \
                         part + tasks[t].offset))                                                             \
            failed = 1;                                                                                       \
    }                                                                                                         \
    if (!failed) {                                                                                            \
        _Pragma("omp parallel for schedule(dynamic, 1)")                                                      \
        for (int i = 0; i < num_tiles; i++) {                                                                 \
            const int n = tiles[4 * i + 2], r0 = tiles[4 * i + 1];                                            \
            float *acc[MAX_SPLITS], *mx[MAX_SPLITS], *sum[MAX_SPLITS], row_out[MAX_DIM];                      \
            for (int j = 0; j < n; j++) {                                                                     \
                const int64_t len = (int64_t)tiles[4 * i + 3] + j;                                           \
                const int nsplit = (int)((len + S - 1) / S);                                                  \
                for (int s = 0; s < nsplit && s < MAX_SPLITS; s++) {                                          \
                    float *base = part + tasks[first[i] + s].offset;                                          \
                    acc[s] = base; mx[s] = base + n * hd; sum[s] = base + n * hd + (int64_t)n * H;            \
                }                                                                                             \
                if (nsplit > MAX_SPLITS) { failed = 1; continue; }                                            \
                for (int h = 0; h < H; h++) {                                                                 \
                    merge_row(acc, mx, sum, nsplit, (int64_t)j * H + h, d, row_out);                          \
                    for (int x = 0; x < d; x++) out[((int64_t)r0 + j) * hd + (int64_t)h * d + x] = STORE(row_out[x]); \
                }                                                                                             \
            }                                                                                                 \
        }                                                                                                     \
    }                                                                                                         \
    free(part); free(tasks); free(first);                                                                     \
    return failed ? -2 : 0;                                                                                   \
}

DEFINE_TILED(paged_tiled_attention_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
DEFINE_TILED(paged_tiled_attention_f32, float, f32_id, f32_id)
