/* y[M, N] = x[M, K] @ W^T in bf16 with fp32 accumulation (AVX512-BF16 vdpbf16ps), W pre-packed.
 *
 * Packed W (see gemm.py): [ceil(N / NB)][K / 2][NB][2], NB = 48 columns per block, columns past N zero;
 * element (n, k) sits at block n / NB, pair k / 2, lane n % NB, half k % 2, so one 64-byte load holds 16
 * columns x 2 consecutive k: exactly vdpbf16ps's operand. K must be even.
 *
 * Work: tasks of (row block of <= MC rows, column block), split statically over the OpenMP threads; a
 * task runs MR x NB register tiles (8 x 3 zmm accumulators) over the whole K. Each output is one fp32 sum
 * rounded once to bf16, so a row's result never depends on the other rows of the batch.
 */
#include <immintrin.h>
#include <stdint.h>

#define NV 3              /* zmm accumulators per row of a tile */
#define NB (16 * NV)      /* columns per block */
#define MR 8              /* rows per tile */
#define MC 96             /* rows per task at most: the task's x rows stay in L2 */

/* y rows [0, mr) x columns [0, ncols) of one block */
static inline void tile(const uint16_t *x, int64_t xs, const uint16_t *p, uint16_t *y, int64_t ys, int K,
                        int mr, int ncols) {
    __m512 acc[MR][NV];
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < NV; j++) acc[r][j] = _mm512_setzero_ps();
    const int32_t *xi[MR];
    for (int r = 0; r < MR; r++) xi[r] = (const int32_t *)(x + (r < mr ? r : 0) * xs);
    for (int kp = 0; kp < K / 2; kp++) {
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

/* x: [M, K] rows at stride xs; y: [M, N] rows at stride ys; p: packed W. Returns 0, or -1 for an odd K. */
int gemm_bf16(const uint16_t *x, int64_t xs, const uint16_t *p, uint16_t *y, int64_t ys, int M, int K, int N) {
    if (K % 2 || M <= 0) return K % 2 ? -1 : 0;
    const int nblocks = (N + NB - 1) / NB, mblocks = (M + MC - 1) / MC;
    const int mc = ((M + mblocks - 1) / mblocks + MR - 1) / MR * MR;   /* balanced row blocks */
#pragma omp parallel for schedule(static)
    for (int task = 0; task < mblocks * nblocks; task++) {
        const int mb = task / nblocks, nb = task % nblocks;
        const int m0 = mb * mc, m1 = m0 + mc < M ? m0 + mc : M;
        const int ncols = N - nb * NB < NB ? N - nb * NB : NB;
        const uint16_t *pn = p + (int64_t)nb * K * NB;
        for (int m = m0; m < m1; m += MR)
            tile(x + (int64_t)m * xs, xs, pn, y + (int64_t)m * ys + nb * NB, ys, K, m1 - m < MR ? m1 - m : MR, ncols);
    }
    return 0;
}
