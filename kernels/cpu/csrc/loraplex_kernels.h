/* The C API of loraplex's CPU kernels: every function a shared library of this folder exports, as the
 * Python side calls it through ctypes (kernels/cpu/c_api.py holds the same signatures, and
 * tests/kernels/cpu/test_c_api.py checks that the two agree and that each library exports its functions).
 * Every .c file includes this header, so the compiler checks each definition against its declaration.
 *
 * Conventions: a function's name ends with the data type it takes (_bf16, _f32); a file that needs an
 * instruction set beyond the build's baseline ends with it (_avx2, _avx512bf16), and a file that works on
 * any CPU but has faster paths for some (lora.c, elementwise.c) chooses them with #if on the compiler's
 * __AVX512BF16__ / __AVX2__ macros. Functions returning int return 0 on success and a negative code for a
 * shape they do not take (documented beside each definition). */
#pragma once
#include <stdint.h>

struct decoder_args;   /* decoder.c */
struct pack_piece;     /* lora_pack.c */

/* elementwise.c */
void rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, uint16_t *out, int64_t out_stride,
                   int64_t rows, int H, float eps);
void rms_norm_f32(const float *x, int64_t x_stride, const float *w, float *out, int64_t out_stride, int64_t rows,
                  int H, float eps);
void add_rms_norm_bf16(uint16_t *x, int64_t x_stride, const uint16_t *d, int64_t d_stride, const uint16_t *w,
                       uint16_t *out, int64_t out_stride, int64_t rows, int H, float eps);
void add_rms_norm_f32(float *x, int64_t x_stride, const float *d, int64_t d_stride, const float *w, float *out,
                      int64_t out_stride, int64_t rows, int H, float eps);
void silu_mul_bf16(const uint16_t *gu, int64_t gu_stride, uint16_t *out, int64_t out_stride, int64_t rows, int I);
void silu_mul_f32(const float *gu, int64_t gu_stride, float *out, int64_t out_stride, int64_t rows, int I);
void gelu_tanh_mul_bf16(const uint16_t *gu, int64_t gu_stride, uint16_t *out, int64_t out_stride, int64_t rows,
                        int I);
void gelu_tanh_mul_f32(const float *gu, int64_t gu_stride, float *out, int64_t out_stride, int64_t rows, int I);
void rope_bf16(uint16_t *x, int64_t row_stride, int64_t rows, int heads, int d, const uint16_t *cos,
               const uint16_t *sin);
void rope_f32(float *x, int64_t row_stride, int64_t rows, int heads, int d, const float *cos, const float *sin);
void dora_scale_bf16(uint16_t *y, int64_t y_stride, const uint16_t *base, const int64_t *offs, int64_t rows, int N);
void dora_scale_f32(float *y, int64_t y_stride, const float *base, const int64_t *offs, int64_t rows, int N);
void write_kv(const char *k, int64_t k_stride, const char *v, int64_t v_stride, char *k_cache, char *v_cache,
              int64_t page_stride, const int64_t *pages, const int64_t *offs, int64_t rows, int64_t row_bytes);
void argmax_bf16(const uint16_t *x, int64_t x_stride, int64_t rows, int64_t n, int64_t *out);
void mask_logits_f32(float *x, int64_t x_stride, int64_t n, const int32_t *mask, int64_t mask_stride,
                     const int64_t *which, int64_t count);
void mask_logits_bf16(uint16_t *x, int64_t x_stride, int64_t n, const int32_t *mask, int64_t mask_stride,
                      const int64_t *which, int64_t count);

/* gemm_avx512bf16.c, gemm_lora_avx512bf16.c, gemm_avx2.c */
int gemm_bf16(const uint16_t *x, int64_t xs, const uint16_t *p, uint16_t *y, int64_t ys, int M, int K, int N);
int gemm_lora_bf16(const uint16_t *x, int64_t xs, const uint16_t *p, uint16_t *y, int64_t ys, int M, int K, int N,
                   const int64_t *slot, const int64_t *rank, const uint16_t *const *a, int R, int G,
                   const uint16_t *const *b, const int64_t *out, uint32_t *vp, int64_t vp_stride);
int gemm_amx(int on);    /* each AVX512-BF16 GEMM library's (and decoder's) switch: gemm_tile.h */
int gemm_bf16_avx2(const uint16_t *x, int64_t xs, const uint16_t *p, uint16_t *y, int64_t ys, int M, int K, int N);

/* lora.c */
int lora_decode_bf16(const uint16_t *x, int64_t x_stride, uint16_t *y, int64_t y_stride, const int64_t *tok,
                     const int64_t *slot, const int64_t *rank, int n, const uint16_t *const *a, int R, int G, int in,
                     const uint16_t *const *b, const int64_t *out);
int lora_decode_f32(const float *x, int64_t x_stride, float *y, int64_t y_stride, const int64_t *tok,
                    const int64_t *slot, const int64_t *rank, int n, const float *const *a, int R, int G, int in,
                    const float *const *b, const int64_t *out);
int lora_segments_bf16(const uint16_t *x, int64_t x_stride, uint16_t *y, int64_t y_stride, const int64_t *tok,
                       const int64_t *seg_start, const int64_t *seg_slot, const int64_t *seg_rank, int n_seg,
                       const uint16_t *const *a, int R, int G, int in, const uint16_t *const *b, const int64_t *out);

/* lora_pack.c */
int pack_lora(const uint8_t *data, const struct pack_piece *pieces, int n, void *out, int bf16);

/* attention_tiled.c, attention_avx512bf16.c */
int paged_tiled_attention_bf16(const uint16_t *q, uint16_t *out, const uint16_t *k, const uint16_t *v,
                               int64_t page_stride, const int32_t *tables, int64_t max_blocks, const int32_t *tiles,
                               int num_tiles, int H, int KVH, int d, int bs, float scale, int split_blocks,
                               int64_t window, float softcap);
int paged_tiled_attention_f32(const float *q, float *out, const float *k, const float *v, int64_t page_stride,
                              const int32_t *tables, int64_t max_blocks, const int32_t *tiles, int num_tiles, int H,
                              int KVH, int d, int bs, float scale, int split_blocks, int64_t window,
                              float softcap);
int paired_attention_bf16(const uint16_t *q, int64_t q_stride, uint16_t *out, const uint16_t *k, const uint16_t *v,
                          int64_t page_stride, const int64_t *tables, int64_t max_blocks, const int64_t *lens, int D,
                          int H, int KVH, int d, int bs, float scale, int64_t window, float softcap);
int write_kv_paired_bf16(const uint16_t *k, int64_t k_stride, const uint16_t *v, int64_t v_stride, uint16_t *k_cache,
                         uint16_t *v_cache, int64_t page_stride, const int64_t *pages, const int64_t *offs, int64_t rows,
                         int KVH, int d, int bs);

/* decoder.c (a unity build of the files above) */
int decoder_layers_bf16(const struct decoder_args *a);
