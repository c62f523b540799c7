/* Software prefetches of a list of byte ranges, spread over a compute-bound loop (the GEMMs' k loops): data
 * a memory-bound step needs next arrives in L2 while the loop computes (and, where L3 is a victim cache of
 * L2 as on AMD Zen, stays in L3 when L2 overflows). Prefetches are hints: a range past WALK_MAX is skipped. */
#pragma once
#include <stdint.h>
#include <xmmintrin.h>

#define PF_EVERY 8   /* k steps between two rounds of prefetches */

/* Spreads software prefetches of a list of byte ranges over a tile's k steps (into L2), so that data a
 * memory-bound step needs next arrives while the tile computes. */
#ifndef WALK_MAX
#define WALK_MAX 1024   /* ranges a walker holds (a file may define more before including this) */
#endif
typedef struct {
    const char *ptr[WALK_MAX];
    int64_t len[WALK_MAX];
    int n, i;
    int64_t off;
    int per_step;     /* lines per k step */
} walker;

static inline void walker_reset(walker *w) { w->n = w->i = 0; w->off = 0; }

static inline void walker_add(walker *w, const void *p, int64_t bytes) {
    if (w->n < WALK_MAX && bytes > 0) { w->ptr[w->n] = (const char *)p; w->len[w->n++] = bytes; }
}

static inline void walker_step(walker *w) {
    int q = w->per_step;
    while (q > 0 && w->i < w->n) {
        const char *p = w->ptr[w->i] + w->off;
        const int64_t left = (w->len[w->i] - w->off + 63) / 64;
        const int c = left < q ? (int)left : q;
        for (int u = 0; u < c; u++) _mm_prefetch(p + 64 * u, _MM_HINT_T1);
        w->off += 64 * c;
        q -= c;
        if (w->off >= w->len[w->i]) { w->i++; w->off = 0; }
    }
}

static inline int64_t walker_lines(const walker *w) {
    int64_t n = 0;
    for (int i = 0; i < w->n; i++) n += (w->len[i] + 63) / 64;
    return n;
}

