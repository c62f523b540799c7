/* Paged attention over a bf16 KV cache in the "paired" block layout, for AVX512-BF16 (vdpbf16ps).
 *
 * vdpbf16ps multiplies 16 pairs of bf16 by one broadcast pair and adds both products to 16 fp32 lanes, so
 * a block stores K and V with the pair that one instruction consumes next to each other:
 *   K block [KVH][d / 2][bs][2]: line (h, p) holds dims 2p, 2p + 1 of bs tokens; 16 tokens' scores for
 *            one query head = d / 2 instructions against the broadcast query pair, no horizontal sums.
 *   V block [KVH][bs / 2][d][2]: row (h, j) holds tokens 2j, 2j + 1 of every dim interleaved; one
 *            instruction adds p[2j] v[2j] + p[2j+1] v[2j+1] to 16 dims of the output.
 * A block is the K or V of bs tokens of one layer inside a page: k + page * page_stride (v likewise).
 * Requires d % 32 == 0 and bs % 16 == 0.
 *
 * paired_attention_bf16: q [D, H, d] bf16 (rows q_stride elements apart, each row's heads contiguous),
 * out [D, H, d] bf16 contiguous; tables [D, max_blocks] int64; lens [D] int64 (>= 1).
 * Each row is one query token over the first lens[row] tokens of its sequence (decode tokens, and
 * prefill tokens each over its own prefix); with window > 0, over the last `window` of them only
 * ([lens[row] - window, lens[row]): a sliding window), the blocks before them not read. With softcap
 * > 0 each score s becomes softcap * tanh(s / softcap) before the softmax (Gemma 2). Scores and
 * softmax in fp32; P is rounded to bf16 for P @ V (as flash attention does); the output is rounded once. Parallel over rows with OpenMP.
 *
 * write_kv_paired_bf16: token t's K and V ([T, KVH * d] rows at a stride) into page pages[t], slot
 * offs[t] of the caches.
 */
#include "loraplex_kernels.h"
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "bf16.h"

#define QG 4        /* query heads per register group */
#define PF_SCORE 16 /* lines of the next row prefetched per score tile ... */
#define PF_PAIR 6   /* ... and per V token pair: together about one row's K and V (see line_cursor) */

#if defined(__AVX512BF16__)
#include <immintrin.h>

/* A thread's rows are memory-bound: their K and V come from scattered pages, and each row's compute is
 * short. While a thread computes one row it prefetches the next row's blocks into L2, a few lines at a
 * time from inside the compute loops (a row's K and V are read 2 * KVH times, so the next row's lines,
 * spread over all of this row's score tiles and V pairs, are all requested about once). Bursts of a
 * whole block at a time were mostly dropped; measured here, 64 rows x 192 tokens x 30 layers: 16-17 ->
 * 20 GB/s (a plain read of the same blocks in the same order: 29 GB/s). */
typedef struct {
    const char *p;              /* the next line to prefetch; NULL when done */
    int64_t left;               /* lines left in this block's K (half 0) or V (half 1) */
    int half;
    const int64_t *t, *end;     /* the next row's block table: the current entry, the end */
    const char *k, *v;
    int64_t page_bytes, lines;  /* lines: of one block's K (as many in its V) */
} line_cursor;

static inline void cursor_next_half(line_cursor *c) {
    if (c->half == 0) {
        c->half = 1;
        c->p = c->v + *c->t * c->page_bytes;
    } else if (++c->t < c->end) {
        c->half = 0;
        c->p = c->k + *c->t * c->page_bytes;
    } else {
        c->p = NULL;
        return;
    }
    c->left = c->lines;
}

static inline __attribute__((always_inline)) void cursor_step(line_cursor *c, int n) {
    while (n > 0 && c->p) {
        const int m = c->left < n ? (int)c->left : n;
        for (int u = 0; u < m; u++) _mm_prefetch(c->p + 64 * u, _MM_HINT_T1);
        c->p += 64 * m;
        n -= m;
        if ((c->left -= m) == 0) cursor_next_half(c);
    }
}

/* Skips the next row's leading blocks that this row reads too (the next prefill token of the same
 * sequence, or a shared prefix): they are in cache already. */
static inline void cursor_skip_shared(line_cursor *c, const int64_t *table, int64_t nblocks) {
    if (!c->p) return;
    int64_t i = 0;
    while (c->t + i < c->end && i < nblocks && c->t[i] == table[i]) i++;
    if (i == 0) return;
    c->t += i;
    if (c->t < c->end) {
        c->half = 0;
        c->left = c->lines;
        c->p = c->k + *c->t * c->page_bytes;
    } else {
        c->p = NULL;
    }
}

static inline line_cursor cursor_of(const uint16_t *k, const uint16_t *v, int64_t page_stride, const int64_t *table,
                                    int64_t len, int bs, int d, int KVH) {
    const int64_t lines = (int64_t)bs * d * KVH * 2 / 64;
    line_cursor c = {NULL, lines, 0, table, table ? table + (len + bs - 1) / bs : NULL, (const char *)k,
                     (const char *)v, page_stride * 2, lines};
    if (table) c.p = c.k + *table * c.page_bytes;
    return c;
}

/* scores of gn <= QG query heads (bf16 pairs q32[g * qs32 + p]) against the 16 tokens of each of nt <= 2 K
 * tiles (tile i: line p at kt[i] + p * bs * 2; n[i] tokens): s[i][g * ss + j] = scale * q_g . k_j for
 * skip[i] <= j < n[i] (the first skip[i] lie before a sliding window); mx[g] = max(mx[g], those) lane by
 * lane. Two tiles share each query broadcast, and even and odd pairs go to separate accumulators: 4 * gn
 * independent chains. */
static inline __attribute__((always_inline)) void score_tiles(const int32_t *q32, int qs32, const uint16_t *const *kt,
                                                              int bs, int d, const int *n, const int *skip, float scale,
                                                              float *const *s, int64_t ss, __m512 *mx, const int gn,
                                                              const int nt, line_cursor *cur) {
    cursor_step(cur, PF_SCORE * nt);
    __m512 acc[2][2][QG];
    for (int i = 0; i < nt; i++)
        for (int g = 0; g < gn; g++) acc[i][0][g] = acc[i][1][g] = _mm512_setzero_ps();
    for (int p = 0; p < d / 2; p += 2)
        for (int e = 0; e < 2; e++) {
            __m512bh kz[2];
            for (int i = 0; i < nt; i++) kz[i] = (__m512bh)_mm512_loadu_si512(kt[i] + (int64_t)(p + e) * bs * 2);
            for (int g = 0; g < gn; g++) {
                const __m512bh qg = (__m512bh)_mm512_set1_epi32(q32[g * qs32 + p + e]);
                for (int i = 0; i < nt; i++) acc[i][e][g] = _mm512_dpbf16_ps(acc[i][e][g], kz[i], qg);
            }
        }
    for (int i = 0; i < nt; i++) {
        const __mmask16 m = (__mmask16)((n[i] >= 16 ? 0xffffu : (1u << n[i]) - 1) & ~((1u << skip[i]) - 1));
        for (int g = 0; g < gn; g++) {
            const __m512 sc = _mm512_mul_ps(_mm512_add_ps(acc[i][0][g], acc[i][1][g]), _mm512_set1_ps(scale));
            _mm512_mask_storeu_ps(s[i] + g * ss, m, sc);
            mx[g] = _mm512_mask_max_ps(mx[g], m, mx[g], sc);
        }
    }
}

/* acc[g][c] (16 dims each, nc <= 4 vectors = dims [c0, c0 + 16 nc)) += sum over the token pairs j of one
 * V block of p32[g * ps32 + j] . v_pair(j); npairs pairs, the last one's odd token masked when `odd`. */
static inline __attribute__((always_inline)) void pv_block(__m512 acc[QG][4], const uint32_t *p32, int64_t ps32,
                                                           const uint16_t *vb, int d, int c0, const int nc,
                                                           int npairs, int odd, const int gn, line_cursor *cur) {
    for (int j = 0; j < npairs; j++) {
        cursor_step(cur, PF_PAIR);
        const uint16_t *row = vb + ((int64_t)j * d + c0) * 2;
        __m512i vz[4];
        for (int c = 0; c < nc; c++) {
            vz[c] = _mm512_loadu_si512(row + 32 * c);
            /* token 2j + 1 is past the end: its slot may hold anything, keep only token 2j */
            if (odd && j == npairs - 1) vz[c] = _mm512_maskz_mov_epi16(0x55555555u, vz[c]);
        }
        for (int g = 0; g < gn; g++) {
            const __m512bh pg = (__m512bh)_mm512_set1_epi32((int)p32[g * ps32 + j]);
            for (int c = 0; c < nc; c++) acc[g][c] = _mm512_dpbf16_ps(acc[g][c], (__m512bh)vz[c], pg);
        }
    }
}

/* one row, KV head h, query heads [g0, g0 + gn) of that KV head, over its keys [lo, len) (lo > 0: a sliding
 * window; the blocks before lo's are not read, and the probabilities of lo's block before lo are 0) */
static inline __attribute__((always_inline)) void head_group(
        const uint16_t *q, uint16_t *out, const uint16_t *k, const uint16_t *v, int64_t page_stride,
        const int64_t *table, int64_t len, int64_t lo, int G, int d, int bs, float scale, float cap, int h,
        int g0, float *s, uint32_t *p32, line_cursor *cur, const int gn) {
    const int64_t nblocks = (len + bs - 1) / bs, ss = (len + 15) / 16 * 16, ps32 = ss / 2;
    const int64_t b0 = lo / bs, t0 = b0 * bs;             /* the first block read, its first token */
    const int64_t piece = (int64_t)bs * d;                 /* elements of one head's K (or V) in a block */
    const int32_t *q32 = (const int32_t *)(q + (int64_t)(h * G + g0) * d);
    float sum[QG];
    __m512 mxv[QG];
    for (int g = 0; g < gn; g++) mxv[g] = _mm512_set1_ps(-FLT_MAX);
    const int64_t ntiles = (len + 15) / 16;          /* 16-token tiles, two at a time */
    for (int64_t i = lo / 16; i < ntiles; i += 2) {
        const uint16_t *kt[2];
        float *st[2];
        int n[2], skip[2];
        const int nt = i + 1 < ntiles ? 2 : 1;
        for (int u = 0; u < nt; u++) {
            const int64_t t = (i + u) * 16;
            kt[u] = k + table[t / bs] * page_stride + h * piece + (t % bs) * 2;
            n[u] = (int)(len - t < 16 ? len - t : 16);
            skip[u] = (int)(lo > t ? lo - t : 0);
            st[u] = s + t;
        }
        if (nt == 2) score_tiles(q32, d / 2, kt, bs, d, n, skip, scale, st, ss, mxv, gn, 2, cur);
        else score_tiles(q32, d / 2, kt, bs, d, n, skip, scale, st, ss, mxv, gn, 1, cur);
    }
    for (int g = 0; g < gn; g++) {
        float *sg = s + g * ss, total = 0.f;
        float m = _mm512_reduce_max_ps(mxv[g]);
        for (int64_t t = t0; t < lo; t++) sg[t] = 0.f;
        if (cap > 0.f) {           /* tanh is increasing: the capped max is the max capped */
            m = cap * tanhf(m / cap);
            for (int64_t t = lo; t < len; t++) sg[t] = cap * tanhf(sg[t] / cap);
        }
        for (int64_t t = lo; t < len; t++) { sg[t] = expf(sg[t] - m); total += sg[t]; }
        sum[g] = total;
        if (len % 2) sg[len] = 0.f;
        for (int64_t t = t0; t < len; t += 32) {     /* fp32 probabilities -> bf16 pairs (2t, 2t + 1) */
            const int64_t left = (len + 1) / 2 * 2 - t, n16 = left < 32 ? left : 32;
            const __mmask16 m0 = n16 >= 16 ? 0xffff : (__mmask16)((1u << n16) - 1);
            const __mmask16 m1 = n16 >= 32 ? 0xffff : n16 <= 16 ? 0 : (__mmask16)((1u << (n16 - 16)) - 1);
            const __m512bh pr = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(m1, sg + t + 16), _mm512_maskz_loadu_ps(m0, sg + t));
            _mm512_mask_storeu_epi16(p32 + g * ps32 + t / 2, (__mmask32)(n16 >= 32 ? 0xffffffffu : (1u << n16) - 1), (__m512i)pr);
        }
    }
    for (int c0 = 0; c0 < d; c0 += 64) {
        const int nc = d - c0 >= 64 ? 4 : (d - c0) / 16;
        __m512 acc[QG][4];
        for (int g = 0; g < gn; g++)
            for (int c = 0; c < 4; c++) acc[g][c] = _mm512_setzero_ps();
        for (int64_t b = b0; b < nblocks; b++) {
            const uint16_t *vb = v + table[b] * page_stride + h * piece;
            const int64_t n = b == nblocks - 1 ? len - b * bs : bs;
            const uint32_t *pb = p32 + b * bs / 2;
            if (nc == 4) pv_block(acc, pb, ps32, vb, d, c0, 4, (int)((n + 1) / 2), (int)(n % 2), gn, cur);
            else pv_block(acc, pb, ps32, vb, d, c0, 2, (int)((n + 1) / 2), (int)(n % 2), gn, cur);
        }
        for (int g = 0; g < gn; g++) {
            const __m512 inv = _mm512_set1_ps(1.f / sum[g]);
            uint16_t *o = out + (int64_t)(h * G + g0 + g) * d + c0;
            for (int c = 0; c < nc; c++)
                _mm256_storeu_si256((__m256i *)(o + 16 * c), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[g][c], inv)));
        }
    }
}

/* The rows of thread `first` of nth (rows first, first + nth, ...), as paired_attention_bf16 runs them in
 * each thread of its parallel region (decoder.c, in each thread of its own). Returns 0, or -2 when the
 * thread's scratch could not be allocated. No barrier: the caller waits for all threads' rows. */
static int attention_rows(const uint16_t *q, int64_t q_stride, uint16_t *out, const uint16_t *k, const uint16_t *v,
                          int64_t page_stride, const int64_t *tables, int64_t max_blocks, const int64_t *lens, int D,
                          int H, int KVH, int d, int bs, float scale, int64_t window, float cap, int first,
                          int nth) {
    const int G = H / KVH;
    if (first < D) {   /* the first row's first lines: no row before it prefetched them */
        line_cursor c = cursor_of(k, v, page_stride, tables + (int64_t)first * max_blocks, lens[first], bs, d, KVH);
        cursor_step(&c, 256);
    }
    int64_t max_len = 1;
    for (int r = first; r < D; r += nth) max_len = lens[r] > max_len ? lens[r] : max_len;
    const int64_t max_ss = (max_len + 15) / 16 * 16;
    float *s = (float *)malloc(sizeof(float) * QG * max_ss + sizeof(uint32_t) * QG * (max_ss / 2) + 64);
    if (!s) return -2;
    for (int r = first; r < D; r += nth) {   /* interleaved: this thread's next row is r + nth */
        const int64_t len = lens[r], ss = (len + 15) / 16 * 16, lo = window > 0 && len > window ? len - window : 0;
        const int64_t *table = tables + (int64_t)r * max_blocks;
        line_cursor cur = cursor_of(k, v, page_stride, r + nth < D ? tables + (int64_t)(r + nth) * max_blocks : NULL,
                                    r + nth < D ? lens[r + nth] : 0, bs, d, KVH);
        cursor_skip_shared(&cur, table, (len + bs - 1) / bs);
        uint32_t *p32 = (uint32_t *)(s + QG * ss);
        const uint16_t *qr = q + (int64_t)r * q_stride;
        uint16_t *outr = out + (int64_t)r * H * d;
        for (int h = 0; h < KVH; h++)
            for (int g0 = 0; g0 < G; g0 += QG) {
                switch (G - g0 < QG ? G - g0 : QG) {   /* a specialised copy per group size */
                case 1: head_group(qr, outr, k, v, page_stride, table, len, lo, G, d, bs, scale, cap, h, g0, s, p32, &cur, 1); break;
                case 2: head_group(qr, outr, k, v, page_stride, table, len, lo, G, d, bs, scale, cap, h, g0, s, p32, &cur, 2); break;
                case 3: head_group(qr, outr, k, v, page_stride, table, len, lo, G, d, bs, scale, cap, h, g0, s, p32, &cur, 3); break;
                default: head_group(qr, outr, k, v, page_stride, table, len, lo, G, d, bs, scale, cap, h, g0, s, p32, &cur, 4); break;
                }
            }
    }
    free(s);
    return 0;
}

/* Whether paired_attention_bf16 takes this shape. */
static int attention_shape_ok(int H, int KVH, int d, int bs) {
    return H % KVH == 0 && d % 32 == 0 && bs % 16 == 0 && d <= 1024;
}

int paired_attention_bf16(const uint16_t *q, int64_t q_stride, uint16_t *out, const uint16_t *k, const uint16_t *v, int64_t page_stride,
                          const int64_t *tables, int64_t max_blocks, const int64_t *lens, int D, int H, int KVH, int d,
                          int bs, float scale, int64_t window, float softcap) {
    if (!attention_shape_ok(H, KVH, d, bs)) return -1;
    int failed = 0;
#pragma omp parallel
    {
        const int rc = attention_rows(q, q_stride, out, k, v, page_stride, tables, max_blocks, lens, D, H, KVH, d, bs,
                                      scale, window, softcap, omp_get_thread_num(), omp_get_num_threads());
        if (rc) {
#pragma omp atomic write
            failed = rc;
        }
    }
    return failed;
}
#else
int paired_attention_bf16(const uint16_t *q, int64_t q_stride, uint16_t *out, const uint16_t *k, const uint16_t *v, int64_t page_stride,
                          const int64_t *tables, int64_t max_blocks, const int64_t *lens, int D, int H, int KVH, int d,
                          int bs, float scale, int64_t window, float softcap) {
    (void)window; (void)softcap; (void)q; (void)q_stride; (void)out; (void)k; (void)v; (void)page_stride; (void)tables; (void)max_blocks; (void)lens; (void)D;
    (void)H; (void)KVH; (void)d; (void)bs; (void)scale;
    return -3;   /* built without AVX512-BF16: attention.py never calls it then */
}
#endif

/* The body of write_kv_paired_bf16: a work-shared loop over the tokens (see gemm_avx512bf16.c's gemm_for). */
static void write_kv_paired_for(const uint16_t *k, int64_t k_stride, const uint16_t *v, int64_t v_stride,
                                uint16_t *k_cache, uint16_t *v_cache, int64_t page_stride, const int64_t *pages,
                                const int64_t *offs, int64_t rows, int KVH, int d, int bs) {
    const int64_t piece = (int64_t)bs * d;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < rows; t++) {
        const int64_t o = offs[t];
        uint16_t *kp = k_cache + pages[t] * page_stride, *vp = v_cache + pages[t] * page_stride;
        const uint16_t *kt = k + t * k_stride, *vt = v + t * v_stride;
        for (int h = 0; h < KVH; h++) {
            uint16_t *kh = kp + h * piece + o * 2, *vh = vp + h * piece + (o / 2) * d * 2 + (o % 2);
            for (int p = 0; p < d / 2; p++) memcpy(kh + (int64_t)p * bs * 2, kt + h * d + 2 * p, 4);
            for (int i = 0; i < d; i++) vh[2 * i] = vt[h * d + i];
        }
    }
}

int write_kv_paired_bf16(const uint16_t *k, int64_t k_stride, const uint16_t *v, int64_t v_stride, uint16_t *k_cache,
                         uint16_t *v_cache, int64_t page_stride, const int64_t *pages, const int64_t *offs, int64_t rows,
                         int KVH, int d, int bs) {
    if (d % 2 || bs % 2) return -1;
    /* each token's writes wait on their own cache misses (a decode step's tokens are on scattered pages):
     * spread them over the threads from a few rows on (measured: a 64-row decode step, 30 layers: 2.6 -> 2.0 ms) */
#pragma omp parallel if (rows > 8)
    write_kv_paired_for(k, k_stride, v, v_stride, k_cache, v_cache, page_stride, pages, offs, rows, KVH, d, bs);
    return 0;
}
