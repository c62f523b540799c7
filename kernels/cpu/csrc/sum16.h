/* AVX-512 helper shared by the C kernels of this package. */
#pragma once
#ifdef __AVX512F__
#include <immintrin.h>

/* lane t of the result = the sum of the 16 lanes of a[t], by a transpose-add tree (45 shuffles and adds
 * for 16 sums, instead of 16 separate horizontal reductions); every a[t] is summed in the same order */
static inline __m512 sum16(const __m512 *a) {
    __m512 x[8], z[4], r[2];
    for (int i = 0; i < 8; i++)      /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] */
        x[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++)      /* per 128-bit lane: element e = that lane's part of vector 4i + e */
        z[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 2; i++)
        r[i] = _mm512_add_ps(_mm512_shuffle_f32x4(z[2 * i], z[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(z[2 * i], z[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(r[0], r[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(r[0], r[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif
