/* Fused elementwise ops of the Llama forward for CPU, each one pass over memory instead of several torch
 * ops (each with its own temporaries). Rounding matches the torch ops they replace in the model dtype:
 * a bf16 result is rounded to nearest even wherever the torch version stores a bf16 tensor.
 *
 * rms_norm:  out[t] = w * to_dtype(x[t] / sqrt(mean(x[t]^2) + eps))      x, out: [T, H] rows at a stride
 * add_rms_norm: x[t] <- to_dtype(x[t] + d[t]) in place (the residual add), then out[t] = rms_norm(x[t])
 * silu_mul:  out[t, i] = silu(gu[t, i]) * gu[t, I + i]                    gu: [T, 2I]; out: [T, I]
 *            (bf16 on AVX512-BF16: 16 at a time, with a polynomial e^x)
 * gelu_tanh_mul: out[t, i] = gelu_tanh(gu[t, i]) * gu[t, I + i]          (Gemma's GeGLU; scalar tanhf)
 * rope:      x[t, h] <- x * cos[t] + rotate_half(x) * sin[t] in place     x: [T, heads, d]; cos, sin: [T, d]
 * dora_scale: y[t] <- to_dtype(y[t] + y[t] * d_t) in place for each row with offs[t] >= 0, d_t = base + offs[t]
 *            ([N]): a DoRA adapter's rows of a projection times its row scales 1 + d (as torch's addcmul)
 * write_kv:  the K and V rows ([T, n] at a stride) of token t into page pages[t], row offs[t] of the
 *            caches (a page's block is [block_size, n] at cache + page * page_stride)
 * Parallel over rows with OpenMP. The bf16/f32 ops' bodies (<op>_for_<dtype>) are work-shared loops
 * (orphaned `omp for`): the public functions run them in a parallel region of their own, decoder.c inside
 * the one region of a whole decoder pass.
 */
#include "loraplex_kernels.h"
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

static inline float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

#define EXP_MAX_ARG 88.72283935546875f   /* ln(FLT_MAX): e^x overflows past it */

/* silu(a) = a / (1 + e^-a); where e^-a would overflow, torch divides by infinity and gets 0 (NaN for -inf):
 * said outright here, as -ffast-math leaves infinities undefined */
static inline float silu(float a) {
    return a < -EXP_MAX_ARG ? a * 0.f : a / (1.f + expf(-a));
}

/* torch's gelu(approximate="tanh"): 0.5 a (1 + tanh(sqrt(2 / pi) (a + 0.044715 a^3))) */
static inline float gelu_tanh(float a) {
    const float beta = 0.7978845608028654f, kappa = 0.044715f;
    return 0.5f * a * (1.f + tanhf(beta * (a + kappa * a * a * a)));
}

#define DEFINE_OPS(SUFFIX, T, LOAD, STORE, ROUND)                                                            \
/* one row of rms_norm: ot = w * to_dtype(xt / sqrt(mean(xt^2) + eps)) (ot may be xt) */                       \
static inline void rms_norm_row_##SUFFIX(const T *xt, const T *w, T *ot, int H, float eps) {                 \
    float ss = 0.f;                                                                                           \
    int i = VECTOR(sumsq, SUFFIX)(xt, H, &ss);                                                                \
    for (; i < H; i++) { const float v = LOAD(xt[i]); ss += v * v; }                                          \
    const float inv = 1.f / sqrtf(ss / H + eps);                                                              \
    for (i = VECTOR(norm, SUFFIX)(xt, w, ot, inv, H); i < H; i++)                                             \
        ot[i] = STORE(LOAD(w[i]) * ROUND(LOAD(xt[i]) * inv));                                                 \
}                                                                                                             \
                                                                                                              \
static void rms_norm_for_##SUFFIX(const T *x, int64_t x_stride, const T *w, T *out, int64_t out_stride,       \
                                  int64_t rows, int H, float eps) {                                           \
    _Pragma("omp for schedule(static)")                                                                       \
    for (int64_t t = 0; t < rows; t++)                                                                        \
        rms_norm_row_##SUFFIX(x + t * x_stride, w, out + t * out_stride, H, eps);                             \
}                                                                                                             \
                                                                                                              \
/* Qwen3's q/k norms in place: the nq + nk heads of d of each row (rows row_stride apart), the first nq with \
 * wq, the rest with wk; each head as rms_norm's row (the same bits as rms_norm over a copy of the heads) */  \
static void head_norms_for_##SUFFIX(T *x, int64_t row_stride, int64_t rows, int nq, int nk, int d,            \
                                    const T *wq, const T *wk, float eps) {                                    \
    _Pragma("omp for schedule(static)")                                                                       \
    for (int64_t r = 0; r < rows * (nq + nk); r++) {                                                          \
        const int h = (int)(r % (nq + nk));                                                                   \
        T *xh = x + r / (nq + nk) * row_stride + (int64_t)h * d;                                              \
        rms_norm_row_##SUFFIX(xh, h < nq ? wq : wk, xh, d, eps);                                              \
    }                                                                                                         \
}                                                                                                             \
                                                                                                              \
/* y[t] <- to_dtype(y[t] + b) in place: a projection's bias (torch's add in the model dtype) */              \
static void add_bias_for_##SUFFIX(T *y, int64_t y_stride, const T *b, int64_t rows, int N) {                 \
    _Pragma("omp for schedule(static)")                                                                       \
    for (int64_t t = 0; t < rows; t++) {                                                                      \
        T *yt = y + t * y_stride;                                                                             \
        for (int i = 0; i < N; i++) yt[i] = STORE(LOAD(yt[i]) + LOAD(b[i]));                                  \
    }                                                                                                         \
}                                                                                                             \
                                                                                                              \
/* DoRA: y[t] <- to_dtype(y[t] + y[t] * d_t) for rows with offs[t] >= 0, d_t = base + offs[t] (addcmul) */   \
static void dora_scale_for_##SUFFIX(T *y, int64_t y_stride, const T *base, const int64_t *offs, int64_t rows,  \
                                    int N) {                                                                  \
    _Pragma("omp for schedule(static)")                                                                       \
    for (int64_t t = 0; t < rows; t++) {                                                                      \
        if (offs[t] < 0) continue;                                                                            \
        T *yt = y + t * y_stride;                                                                             \
        const T *d = base + offs[t];                                                                          \
        for (int i = 0; i < N; i++) { const float v = LOAD(yt[i]); yt[i] = STORE(v + v * LOAD(d[i])); }     \
    }                                                                                                         \
}                                                                                                             \
                                                                                                              \
static void add_rms_norm_for_##SUFFIX(T *x, int64_t x_stride, const T *d, int64_t d_stride, const T *w,       \
                                      T *out, int64_t out_stride, int64_t rows, int H, float eps) {           \
    _Pragma("omp for schedule(static)")                                                                       \
    for (int64_t t = 0; t < rows; t++) {                                                                      \
        T *xt = x + t * x_stride;                                                                             \
        const T *dt = d + t * d_stride;                                                                       \
        float ss = 0.f;                                                                                       \
        int i = VECTOR(add_sumsq, SUFFIX)(xt, dt, H, &ss);                                                    \
        for (; i < H; i++) {                                                                                  \
            xt[i] = STORE(LOAD(xt[i]) + LOAD(dt[i]));                                                         \
            const float v = LOAD(xt[i]);                                                                      \
            ss += v * v;                                                                                      \
        }                                                                                                     \
        const float inv = 1.f / sqrtf(ss / H + eps);                                                          \
        T *ot = out + t * out_stride;                                                                         \
        for (i = VECTOR(norm, SUFFIX)(xt, w, ot, inv, H); i < H; i++)                                         \
            ot[i] = STORE(LOAD(w[i]) * ROUND(LOAD(xt[i]) * inv));                                             \
    }                                                                                                         \
}                                                                                                             \
                                                                                                              \
static void silu_mul_for_##SUFFIX(const T *gu, int64_t gu_stride, T *out, int64_t out_stride, int64_t rows,   \
                                  int I) {                                                                    \
    _Pragma("omp for schedule(static)")                                                                       \
    for (int64_t t = 0; t < rows; t++) {                                                                      \
        const T *g = gu + t * gu_stride, *u = g + I;                                                          \
        T *ot = out + t * out_stride;                                                                         \
        for (int i = VECTOR(silu, SUFFIX)(g, u, ot, I); i < I; i++) {                                          \
            const float a = LOAD(g[i]);                                                                       \
            ot[i] = STORE(ROUND(silu(a)) * LOAD(u[i]));                                                       \
        }                                                                                                     \
    }                                                                                                         \
}                                                                                                             \
                                                                                                              \
static void gelu_tanh_mul_for_##SUFFIX(const T *gu, int64_t gu_stride, T *out, int64_t out_stride,           \
                                       int64_t rows, int I) {                                                 \
    _Pragma("omp for schedule(static)")                                                                       \
    for (int64_t t = 0; t < rows; t++) {                                                                      \
        const T *g = gu + t * gu_stride, *u = g + I;                                                          \
        T *ot = out + t * out_stride;                                                                         \
        for (int i = 0; i < I; i++) ot[i] = STORE(ROUND(gelu_tanh(LOAD(g[i]))) * LOAD(u[i]));                 \
    }                                                                                                         \
}                                                                                                             \
                                                                                                              \
static void rope_for_##SUFFIX(T *x, int64_t row_stride, int64_t rows, int heads, int d, const T *cos,         \
                              const T *sin) {                                                                 \
    const int half = d / 2;                                                                                   \
    _Pragma("omp for schedule(static)")                                                                       \
    for (int64_t t = 0; t < rows; t++) {                                                                      \
        const T *c = cos + t * d, *s = sin + t * d;                                                           \
        for (int h = 0; h < heads; h++) {                                                                     \
            T *xh = x + t * row_stride + (int64_t)h * d;                                                      \
            for (int i = VECTOR(rope, SUFFIX)(xh, c, s, half); i < half; i++) {                               \
                const float x1 = LOAD(xh[i]), x2 = LOAD(xh[i + half]);                                        \
                const float lo = ROUND(x1 * LOAD(c[i])) + ROUND(-x2 * LOAD(s[i]));                            \
                const float hi = ROUND(x2 * LOAD(c[i + half])) + ROUND(x1 * LOAD(s[i + half]));               \
                xh[i] = STORE(lo);                                                                            \
                xh[i + half] = STORE(hi);                                                                     \
            }                                                                                                 \
        }                                                                                                     \
    }                                                                                                         \
}                                                                                                             \
/* the public ops: one parallel region each (decoder.c runs the _for bodies inside its own) */                \
void rms_norm_##SUFFIX(const T *x, int64_t x_stride, const T *w, T *out, int64_t out_stride, int64_t rows,    \
                       int H, float eps) {                                                                    \
    _Pragma("omp parallel") rms_norm_for_##SUFFIX(x, x_stride, w, out, out_stride, rows, H, eps);             \
}                                                                                                             \
void add_rms_norm_##SUFFIX(T *x, int64_t x_stride, const T *d, int64_t d_stride, const T *w, T *out,          \
                           int64_t out_stride, int64_t rows, int H, float eps) {                              \
    _Pragma("omp parallel")                                                                                   \
    add_rms_norm_for_##SUFFIX(x, x_stride, d, d_stride, w, out, out_stride, rows, H, eps);                    \
}                                                                                                             \
void silu_mul_##SUFFIX(const T *gu, int64_t gu_stride, T *out, int64_t out_stride, int64_t rows, int I) {     \
    _Pragma("omp parallel") silu_mul_for_##SUFFIX(gu, gu_stride, out, out_stride, rows, I);                   \
}                                                                                                             \
void gelu_tanh_mul_##SUFFIX(const T *gu, int64_t gu_stride, T *out, int64_t out_stride, int64_t rows, int I) {\
    _Pragma("omp parallel") gelu_tanh_mul_for_##SUFFIX(gu, gu_stride, out, out_stride, rows, I);              \
}                                                                                                             \
void rope_##SUFFIX(T *x, int64_t row_stride, int64_t rows, int heads, int d, const T *cos, const T *sin) {   \
    _Pragma("omp parallel") rope_for_##SUFFIX(x, row_stride, rows, heads, d, cos, sin);                       \
}                                                                                                             \
void dora_scale_##SUFFIX(T *y, int64_t y_stride, const T *base, const int64_t *offs, int64_t rows, int N) {   \
    _Pragma("omp parallel if (rows * (int64_t)N > 65536)")                                                    \
    dora_scale_for_##SUFFIX(y, y_stride, base, offs, rows, N);                                                \
}

void write_kv(const char *k, int64_t k_stride, const char *v, int64_t v_stride, char *k_cache, char *v_cache,
              int64_t page_stride, const int64_t *pages, const int64_t *offs, int64_t rows, int64_t row_bytes) {
    /* rows land on scattered pages: each copy waits on its own cache misses, so spread them */
    _Pragma("omp parallel for schedule(static) if (rows > 64)")
    for (int64_t t = 0; t < rows; t++) {
        const int64_t at = pages[t] * page_stride + offs[t] * row_bytes;
        memcpy(k_cache + at, k + t * k_stride, row_bytes);
        memcpy(v_cache + at, v + t * v_stride, row_bytes);
    }
}

/* The vector parts of the bf16 ops (AVX512-BF16, 16 elements at a time, the same arithmetic and roundings
 * as the scalar loops): each does a row's leading elements and returns how many; the scalar loop does the
 * rest. sumsq and add_sumsq add their squares to *ss (in a different order than the scalar loop: the fp32
 * sum may differ in its last bit). The f32 ops have none (they return 0). */
#define VECTOR(op, SUFFIX) op##_vector_##SUFFIX
static inline int sumsq_vector_f32(const float *x, int H, float *ss) { (void)x; (void)H; (void)ss; return 0; }
static inline int add_sumsq_vector_f32(float *x, const float *d, int H, float *ss) {
    (void)x; (void)d; (void)H; (void)ss;
    return 0;
}
static inline int norm_vector_f32(const float *x, const float *w, float *o, float inv, int H) {
    (void)x; (void)w; (void)o; (void)inv; (void)H;
    return 0;
}
static inline int rope_vector_f32(float *x, const float *c, const float *s, int half) {
    (void)x; (void)c; (void)s; (void)half;
    return 0;
}
static inline int silu_vector_f32(const float *g, const float *u, float *o, int I) {
    (void)g; (void)u; (void)o; (void)I;
    return 0;
}

#if defined(__AVX512BF16__)
#include <immintrin.h>

/* e^x for x <= ln(FLT_MAX) within ~1 ulp (larger x clamped; 0 below the denormals): 2^n * p(f),
 * x = n ln2 + f, |f| <= ln2 / 2, p the degree-6 minimax polynomial of Cephes' expf, 2^n by vscalefps */
static inline __m512 exp_ps(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(EXP_MAX_ARG)), _mm512_set1_ps(-104.f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    f = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), f);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(f, f), _mm512_add_ps(f, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(p, n);          /* p * 2^n, with over- and underflow handled */
}

static inline __m512 load_bf16x16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline __m512 round_bf16x16(__m512 x) { return _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(x)); }

static inline void store_bf16x16(uint16_t *p, __m512 x) {
    _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(x));
}

static inline int sumsq_vector_bf16(const uint16_t *x, int H, float *ss) {
    __m512 acc = _mm512_setzero_ps();
    int i = 0;
    for (; i + 16 <= H; i += 16) {
        const __m512 v = load_bf16x16(x + i);
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    *ss += _mm512_reduce_add_ps(acc);
    return i;
}

static inline int add_sumsq_vector_bf16(uint16_t *x, const uint16_t *d, int H, float *ss) {
    __m512 acc = _mm512_setzero_ps();
    int i = 0;
    for (; i + 16 <= H; i += 16) {
        const __m512 v = round_bf16x16(_mm512_add_ps(load_bf16x16(x + i), load_bf16x16(d + i)));
        store_bf16x16(x + i, v);
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    *ss += _mm512_reduce_add_ps(acc);
    return i;
}

static inline int norm_vector_bf16(const uint16_t *x, const uint16_t *w, uint16_t *o, float inv, int H) {
    int i = 0;
    for (; i + 16 <= H; i += 16)
        store_bf16x16(o + i, _mm512_mul_ps(load_bf16x16(w + i), round_bf16x16(_mm512_mul_ps(load_bf16x16(x + i),
                                                                                            _mm512_set1_ps(inv)))));
    return i;
}

static inline __m512 neg(__m512 x) {         /* -x, the sign bit flipped (zeros too) */
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000u)));
}

static inline int rope_vector_bf16(uint16_t *x, const uint16_t *c, const uint16_t *s, int half) {
    int i = 0;
    for (; i + 16 <= half; i += 16) {
        const __m512 x1 = load_bf16x16(x + i), x2 = load_bf16x16(x + i + half);
        const __m512 lo = _mm512_add_ps(round_bf16x16(_mm512_mul_ps(x1, load_bf16x16(c + i))),
                                        round_bf16x16(_mm512_mul_ps(neg(x2), load_bf16x16(s + i))));
        const __m512 hi = _mm512_add_ps(round_bf16x16(_mm512_mul_ps(x2, load_bf16x16(c + i + half))),
                                        round_bf16x16(_mm512_mul_ps(x1, load_bf16x16(s + i + half))));
        store_bf16x16(x + i, lo);
        store_bf16x16(x + i + half, hi);
    }
    return i;
}

/* 16 at a time: the same steps as the scalar loop (silu rounded to bf16, then times up) */
static inline int silu_vector_bf16(const uint16_t *g, const uint16_t *u, uint16_t *o, int I) {
    int i = 0;
    for (; i + 16 <= I; i += 16) {
        const __m512 a = load_bf16x16(g + i);
        const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), a));     /* finite: as silu() */
        __m512 s = _mm512_div_ps(a, _mm512_add_ps(_mm512_set1_ps(1.f), e));
        s = _mm512_mask_mul_ps(s, _mm512_cmp_ps_mask(a, _mm512_set1_ps(-EXP_MAX_ARG), _CMP_LT_OQ), a,
                               _mm512_setzero_ps());
        const __m512 sr = _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(s));
        _mm256_storeu_si256((__m256i *)(o + i), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(sr, load_bf16x16(u + i))));
    }
    return i;
}
#else
static inline int sumsq_vector_bf16(const uint16_t *x, int H, float *ss) { (void)x; (void)H; (void)ss; return 0; }
static inline int add_sumsq_vector_bf16(uint16_t *x, const uint16_t *d, int H, float *ss) {
    (void)x; (void)d; (void)H; (void)ss;
    return 0;
}
static inline int norm_vector_bf16(const uint16_t *x, const uint16_t *w, uint16_t *o, float inv, int H) {
    (void)x; (void)w; (void)o; (void)inv; (void)H;
    return 0;
}
static inline int rope_vector_bf16(uint16_t *x, const uint16_t *c, const uint16_t *s, int half) {
    (void)x; (void)c; (void)s; (void)half;
    return 0;
}
static inline int silu_vector_bf16(const uint16_t *g, const uint16_t *u, uint16_t *o, int I) {
    (void)g; (void)u; (void)o; (void)I;
    return 0;
}
#endif

DEFINE_OPS(bf16, uint16_t, bf16_to_f32, f32_to_bf16, round_bf16)
DEFINE_OPS(f32, float, f32_id, f32_id, f32_id)

/* argmax_bf16: out[t] = torch.argmax(x[t]) for bf16 rows [T, n] at a stride: the first index of the largest
 * value, or of the first NaN when the row has one (torch treats NaN as the largest). -0 equals +0;
 * denormals keep their order (the library is linked without -ffast-math's start-up code, so nothing in
 * the process runs in denormals-are-zero mode).
 * Greedy sampling reads a decode step's logits once here instead of converting them to fp32 first.
 * Compared as integers (bf16 bits mapped to an order-preserving key), which -ffast-math leaves exact. */
static inline int32_t bf16_key(uint16_t b) {
    const int32_t s = (int16_t)((b & 0x7fff) == 0 ? 0 : b);   /* -0 -> +0 */
    return s >= 0 ? s : s ^ 0x7fff;
}

void argmax_bf16(const uint16_t *x, int64_t x_stride, int64_t rows, int64_t n, int64_t *out) {
    _Pragma("omp parallel for schedule(static)")
    for (int64_t t = 0; t < rows; t++) {
        const uint16_t *xt = x + t * x_stride;
        int32_t m = INT32_MIN;
        int nan = 0;
        _Pragma("omp simd reduction(max:m) reduction(|:nan)")
        for (int64_t i = 0; i < n; i++) {       /* pass 1 (vectorised): the largest key; any NaN */
            const int32_t k = bf16_key(xt[i]);
            m = k > m ? k : m;
            nan |= (xt[i] & 0x7fff) > 0x7f80;
        }
        int64_t i = 0;                           /* pass 2 (the row is in L2 now): its first index */
        if (nan)
            while ((xt[i] & 0x7fff) <= 0x7f80) i++;
        else
            while (bf16_key(xt[i]) != m) i++;
        out[t] = i;
    }
}

/* mask_logits_<dtype>: for each row r = which[j] of logits [B, n] at a stride, x[r, i] <- -inf where bit
 * i % 32 of mask[r, i / 32] is 0 (a structured output's allowed tokens: xgrammar's bitmask layout, one
 * int32 word per 32 token ids, a row of ceil(n / 32) words at mask_stride). Allowed entries are untouched;
 * words with every bit set are skipped. */
#define MASK_LOGITS(NAME, T, NEG_INF)                                                                        \
    void NAME(T *x, int64_t x_stride, int64_t n, const int32_t *mask, int64_t mask_stride, const int64_t *which, \
              int64_t count) {                                                                             \
        _Pragma("omp parallel for schedule(static)")                                                       \
        for (int64_t j = 0; j < count; j++) {                                                              \
            T *xr = x + which[j] * x_stride;                                                               \
            const uint32_t *mr = (const uint32_t *)(mask + which[j] * mask_stride);                        \
            for (int64_t w = 0; w * 32 < n; w++) {                                                         \
                const uint32_t bits = mr[w];                                                               \
                if (bits == 0xffffffffu)                                                                   \
                    continue;                                                                              \
                const int64_t end = (w + 1) * 32 < n ? (w + 1) * 32 : n;                                   \
                _Pragma("omp simd")                                                                        \
                for (int64_t i = w * 32; i < end; i++)                                                     \
                    xr[i] = (bits >> (i - w * 32)) & 1u ? xr[i] : (NEG_INF);                               \
            }                                                                                              \
        }                                                                                                  \
    }

MASK_LOGITS(mask_logits_f32, float, -INFINITY)
MASK_LOGITS(mask_logits_bf16, uint16_t, (uint16_t)0xff80u)   /* bf16 -inf */
