/* Every decoder layer of a Llama model over one step's T tokens, in one call and one OpenMP parallel region
 * (AVX512-BF16, bf16, the paired KV layout): the layer loop of engine/model/llama.py without its ~10
 * Python-to-C calls and parallel regions per layer. Each stage is the same kernel body the separate
 * calls run (a unity build of gemm.c, elementwise.c and paired_attention.c), and the stages are separated
 * by barriers, so the result has exactly the bits of the per-op path. Per layer:
 *
 *   qkv = h @ Wqkv^T; rope(q, k); K/V -> cache; attn = attention(q); o = attn @ Wo^T;
 *   x += o, h = rms_norm(x); act = silu(gate) * up of h @ Wgate_up^T; down = act @ Wdown^T;
 *   x += down, h = rms_norm(x) with the next layer's weight (the last layer leaves x += down to the caller).
 *
 * Before the first layer h = rms_norm(x) with its input norm. Shapes: x, h, o, down [T, H]; qkv
 * [T, Q + 2 KV] (Q = heads * d, KV = kv_heads * d); attn [T, Q]; gate_up [T, 2I]; act [T, I]; all rows
 * contiguous. cos, sin [T, d]; pages, offs [T] (the tokens' K/V slots); tables [T, max_blocks], lens [T]
 * (every token is one query row over its own prefix, as paired_attention_bf16 takes them).
 */
#include "gemm.c"
#include "elementwise.c"
#include "paired_attention.c"

typedef struct {
    const uint16_t *qkv, *o, *gate_up, *down;   /* packed weights (gemm_tile.h's layout) */
    const uint16_t *input_norm, *post_norm;     /* [H] */
    const uint16_t *k_cache, *v_cache;          /* the layer's paired K and V views at page 0 */
} decoder_layer;

typedef struct {
    int num_layers, T, H, heads, kv_heads, d, I, block_size;
    int64_t page_stride, max_blocks;            /* elements between pages; block table width */
    float eps, scale;
    const decoder_layer *layers;
    uint16_t *x, *h, *qkv, *attn, *o, *gate_up, *act, *down;
    const uint16_t *cos, *sin;
    const int64_t *pages, *offs, *tables, *lens;
} decoder_args;

#if defined(__AVX512BF16__)
/* One layer, run by every thread of the region; returns this thread's attention status (0 or -2). */
static int layer(const decoder_args *a, int l, int t, int nth) {
    const decoder_layer *w = a->layers + l;
    const int H = a->H, T = a->T, d = a->d, Q = a->heads * d, KV = a->kv_heads * d, N = Q + 2 * KV, I2 = 2 * a->I;
    gemm_for(a->h, H, w->qkv, a->qkv, N, T, H, N);
    rope_for_bf16(a->qkv, N, T, a->heads + a->kv_heads, d, a->cos, a->sin);
    write_kv_paired_for(a->qkv + Q, N, a->qkv + Q + KV, N, (uint16_t *)w->k_cache, (uint16_t *)w->v_cache,
                        a->page_stride, a->pages, a->offs, T, a->kv_heads, d, a->block_size);
    const int rc = attention_rows(a->qkv, N, a->attn, w->k_cache, w->v_cache, a->page_stride, a->tables,
                                  a->max_blocks, a->lens, T, a->heads, a->kv_heads, d, a->block_size, a->scale, t, nth);
#pragma omp barrier
    gemm_for(a->attn, Q, w->o, a->o, H, T, Q, H);
    add_rms_norm_for_bf16(a->x, H, a->o, H, w->post_norm, a->h, H, T, H, a->eps);
    gemm_for(a->h, H, w->gate_up, a->gate_up, I2, T, H, I2);
    silu_mul_for_bf16(a->gate_up, I2, a->act, a->I, T, a->I);
    gemm_for(a->act, a->I, w->down, a->down, H, T, a->I, H);
    if (l + 1 < a->num_layers)
        add_rms_norm_for_bf16(a->x, H, a->down, H, a->layers[l + 1].input_norm, a->h, H, T, H, a->eps);
    return rc;
}

/* Returns 0; -1 for a shape the kernels do not take (odd H, Q or I; see paired_attention_bf16); -2 when
 * attention scratch could not be allocated (the outputs are then undefined). */
int decoder_layers_bf16(const decoder_args *a) {
    if (a->H % 2 || a->I % 2 || (a->heads * a->d) % 2 || !attention_shape_ok(a->heads, a->kv_heads, a->d, a->block_size))
        return -1;
    if (a->T <= 0) return 0;
    int failed = 0;
#pragma omp parallel
    {
        const int t = omp_get_thread_num(), nth = omp_get_num_threads();
        rms_norm_for_bf16(a->x, a->H, a->layers[0].input_norm, a->h, a->H, a->T, a->H, a->eps);
        for (int l = 0; l < a->num_layers; l++) {
            const int rc = layer(a, l, t, nth);
            if (rc) {
#pragma omp atomic write
                failed = rc;
            }
        }
    }
    return failed;
}
#else
int decoder_layers_bf16(const decoder_args *a) {
    (void)a;
    return -3;   /* built without AVX512-BF16: decoder.py never calls it then */
}
#endif
