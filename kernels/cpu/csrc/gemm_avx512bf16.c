/* y[M, N] = x[M, K] @ W^T in bf16 with fp32 accumulation (AVX512-BF16 vdpbf16ps), W pre-packed (see
 * gemm_tile.h for the layout and the register tile).
 *
 * Work: tasks of (row block of <= MC rows, column block), split statically over the OpenMP threads; a
 * task runs the tiles of its rows over the whole K. Each output is one fp32 sum rounded once to bf16, so
 * a row's result never depends on the other rows of the batch.
 */
#ifndef GEMM_AVX512BF16_C   /* also included by gemm_lora_avx512bf16.c, both included by decoder.c */
#define GEMM_AVX512BF16_C
#include "loraplex_kernels.h"
#include "gemm_tile.h"

/* The body of gemm_bf16, run by every thread of the enclosing parallel region (a work-shared loop, with
 * its implicit barrier); outside one, by the caller alone. */
static void gemm_for(const uint16_t *x, int64_t xs, const uint16_t *p, uint16_t *y, int64_t ys, int M, int K, int N) {
    const int nblocks = (N + NB - 1) / NB, mblocks = (M + MC - 1) / MC;
    const int mc = ((M + mblocks - 1) / mblocks + MR - 1) / MR * MR;   /* balanced row blocks */
#pragma omp for schedule(static)
    for (int task = 0; task < mblocks * nblocks; task++) {
        const int mb = task / nblocks, nb = task % nblocks;
        const int m0 = mb * mc, m1 = m0 + mc < M ? m0 + mc : M;
        const int ncols = N - nb * NB < NB ? N - nb * NB : NB;
        const uint16_t *pn = p + (int64_t)nb * K * NB;
        for (int m = m0; m < m1; m += MR)
            tile(x + (int64_t)m * xs, xs, pn, y + (int64_t)m * ys + nb * NB, ys, K, m1 - m < MR ? m1 - m : MR, ncols,
                 0, m, nb * NB, 0, nb + 1 < nblocks ? pn + (int64_t)K * NB : 0, (m - m0) / MR, (m1 - m0 + MR - 1) / MR);
    }
}

/* x: [M, K] rows at stride xs; y: [M, N] rows at stride ys; p: packed W. Returns 0, or -1 for an odd K. */
int gemm_bf16(const uint16_t *x, int64_t xs, const uint16_t *p, uint16_t *y, int64_t ys, int M, int K, int N) {
    if (K % 2 || M <= 0) return K % 2 ? -1 : 0;
#pragma omp parallel
    gemm_for(x, xs, p, y, ys, M, K, N);
    return 0;
}
#endif
