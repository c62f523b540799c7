/* Every decoder layer of a Llama model over one step's T tokens, in one call and one OpenMP parallel region
 * (AVX512-BF16, bf16, the paired KV layout): the layer loop of engine/model/llama.py without its ~10
 * Python-to-C calls and parallel regions per layer. Each stage is the same kernel body the separate
 * calls run (a unity build of gemm_avx512bf16.c, gemm_lora_avx512bf16.c, lora.c, elementwise.c and attention_avx512bf16.c),
 * and the stages are separated by barriers, so the result has exactly the bits of the per-op path. Per
 * layer:
 *
 *   qkv = h @ Wqkv^T (+ its bias); q/k head norms; rope(q, k) (the sliding layers' own tables where the
 *   model has them); K/V -> cache; attn = attention(q) (in the layer's sliding window, soft-capped, if
 *   the model says so); o = attn @ Wo^T (then rms_norm(o) with sandwich norms);
 *   x += o, h = rms_norm(x); act = silu(gate) * up (or gelu_tanh(gate) * up) of h @ Wgate_up^T;
 *   down = act @ Wdown^T (then rms_norm(down) with sandwich norms);
 *   x += down, h = rms_norm(x) with the next layer's weight (the last layer leaves x += down to the caller).
 *
 * Before the first layer h = rms_norm(x) with its input norm. Shapes: x, h, o, down [T, H]; qkv
 * [T, Q + 2 KV] (Q = heads * d, KV = kv_heads * d); attn [T, Q]; gate_up [T, 2I]; act [T, I]; all rows
 * contiguous. cos, sin [T, d]; pages, offs [T] (the tokens' K/V slots); tables [T, max_blocks], lens [T]
 * (every token is one query row over its own prefix, as paired_attention_bf16 takes them).
 *
 * With `lora`, each projection group that has one computes the multi-LoRA of the rows with a slot inside
 * the GEMM, as gemm_lora_bf16 does (decode tokens), then adds the segments' deltas, as lora_segments_bf16
 * does (prefill tokens grouped by adapter): the order of the op-by-op path (LlamaModel._layers). With `dora`,
 * a group's rows of DoRA adapters are then scaled by 1 + d, as dora_scale_bf16 does (before any bias).
 */
#include "loraplex_kernels.h"
#include "gemm_avx512bf16.c"
#include "gemm_lora_avx512bf16.c"
#include "lora.c"
#include "elementwise.c"
#include "attention_avx512bf16.c"

#define NGROUPS 4   /* projection groups per layer: qkv, o, gate_up, down */

/* One projection group's multi-LoRA for the step (gemm_lora_avx512bf16.c's arguments); a == NULL: none. */
typedef struct {
    const uint16_t *const *a;                   /* [S] each slot's A [R][G][in] */
    int R, G;
    const uint16_t *const *b;                   /* [S][G]: b[s * G + g] */
    const int64_t *out;
} decoder_lora;

typedef struct {
    const uint16_t *qkv, *o, *gate_up, *down;   /* packed weights (gemm_tile.h's layout) */
    const uint16_t *input_norm, *post_norm;     /* [H] */
    const uint16_t *k_cache, *v_cache;          /* the layer's paired K and V views at page 0 */
    const uint16_t *qkv_bias;                   /* [Q + 2 KV], or NULL: none (the family's switches, */
    const uint16_t *q_norm, *k_norm;            /* engine/model/family.py); [d] each, or NULL: none */
    int64_t window;                             /* the layer's sliding window; 0: global attention */
    const uint16_t *attn_out_norm, *mlp_out_norm;   /* [H] sandwich norms (Gemma), or NULL: none */
    int64_t local_rope;                         /* 1: rope with the args' local tables (Gemma 3's sliding layers) */
} decoder_layer;

typedef struct decoder_args {
    int num_layers, T, H, heads, kv_heads, d, I, block_size;
    int64_t page_stride, max_blocks;            /* elements between pages; block table width */
    float eps, scale;
    const decoder_layer *layers;
    uint16_t *x, *h, *qkv, *attn, *o, *gate_up, *act, *down;
    const uint16_t *cos, *sin;
    const int64_t *pages, *offs, *tables, *lens;
    const decoder_lora *lora;                   /* [num_layers][NGROUPS], or NULL: no adapter in the step */
    const int64_t *slot, *rank;                 /* [T] each row's LoRA slot in the GEMM (-1: none) and rank */
    uint32_t *vp;                               /* [T, vp_stride] scratch (the shrinks' results) */
    int64_t vp_stride;
    const int64_t *seg_tok, *seg_start, *seg_slot, *seg_rank;   /* lora_segments_bf16's segments */
    int n_seg;
    const uint16_t *local_cos, *local_sin;      /* [T, d] the sliding layers' own RoPE tables, or NULL */
    float softcap;                              /* attention scores' soft-cap (Gemma 2); 0: none */
    int gelu;                                   /* 1: GeGLU (gelu_tanh(gate) * up); 0: SwiGLU */
    const uint16_t *dora_base;                  /* the pool's storage: DoRA adapters' vectors of g - 1 */
    const int64_t *const *dora;                 /* [num_layers][NGROUPS] each row's offset of its vector in */
} decoder_args;                                 /* dora_base ([T], -1: none), or NULL: no DoRA row; or NULL */

/* What one thread needs besides the arguments: the rows with an adapter, its prefetch walker. */
typedef struct {
    const int64_t *rows;
    int nrows;
    const int *group;                           /* the rows' groups of one adapter (row_groups) */
    int ngroups;
    walker *w;
    int64_t tasks;                              /* the segments' tasks (segment_tasks) */
    const int64_t *task_seg;
} step_state;

#if defined(__AVX512BF16__)
/* y [T, N] = x [T, K] @ W^T of projection group g of layer l, with its decode rows' LoRA inside when the
 * group has one (gemm_lora_avx512bf16.c), then its segments' deltas (lora_segments_bf16's body); every thread of the
 * region calls it, and it ends with all threads done. */
static void project(const decoder_args *a, const step_state *st, int l, int g, const uint16_t *x, int K,
                    const uint16_t *p, uint16_t *y, int N) {
    const decoder_lora *lo = a->lora ? a->lora + (int64_t)l * NGROUPS + g : 0;
    if (!lo || !lo->a || st->nrows == 0) {
        gemm_for(x, K, p, y, N, a->T, K, N);
    } else {
        const job j = make_job(x, K, p, y, N, a->T, K, N, st->rows, st->nrows, st->group, st->ngroups, a->slot, a->rank, lo->a, lo->G, lo->b, lo->out, a->vp, a->vp_stride);
        gemm_lora_run(&j, st->w);
#pragma omp barrier
    }
    if (lo && lo->a && st->tasks > 0)
        segments_for(x, K, y, N, a->seg_tok, a->seg_start, a->seg_slot, a->seg_rank, lo->a, lo->G,
                     K, lo->b, lo->out, st->tasks, st->task_seg);
    const int64_t *dora = a->dora ? a->dora[(int64_t)l * NGROUPS + g] : 0;
    if (dora) dora_scale_for_bf16(y, N, a->dora_base, dora, a->T, N);   /* DoRA rows: y (1 + d), before a bias */
}

/* One layer, run by every thread of the region; returns this thread's attention status (0 or -2). */
static int layer(const decoder_args *a, const step_state *st, int l, int t, int nth) {
    const decoder_layer *w = a->layers + l;
    const int H = a->H, T = a->T, d = a->d, Q = a->heads * d, KV = a->kv_heads * d, N = Q + 2 * KV, I2 = 2 * a->I;
    project(a, st, l, 0, a->h, H, w->qkv, a->qkv, N);
    if (w->qkv_bias) add_bias_for_bf16(a->qkv, N, w->qkv_bias, T, N);
    if (w->q_norm) head_norms_for_bf16(a->qkv, N, T, a->heads, a->kv_heads, d, w->q_norm, w->k_norm, a->eps);
    const int local = w->local_rope && a->local_cos;
    rope_for_bf16(a->qkv, N, T, a->heads + a->kv_heads, d, local ? a->local_cos : a->cos, local ? a->local_sin : a->sin);
    write_kv_paired_for(a->qkv + Q, N, a->qkv + Q + KV, N, (uint16_t *)w->k_cache, (uint16_t *)w->v_cache,
                        a->page_stride, a->pages, a->offs, T, a->kv_heads, d, a->block_size);
    const int rc = attention_rows(a->qkv, N, a->attn, w->k_cache, w->v_cache, a->page_stride, a->tables,
                                  a->max_blocks, a->lens, T, a->heads, a->kv_heads, d, a->block_size, a->scale,
                                  w->window, a->softcap, t, nth);
#pragma omp barrier
    project(a, st, l, 1, a->attn, Q, w->o, a->o, H);
    if (w->attn_out_norm) rms_norm_for_bf16(a->o, H, w->attn_out_norm, a->o, H, T, H, a->eps);
    add_rms_norm_for_bf16(a->x, H, a->o, H, w->post_norm, a->h, H, T, H, a->eps);
    project(a, st, l, 2, a->h, H, w->gate_up, a->gate_up, I2);
    if (a->gelu) gelu_tanh_mul_for_bf16(a->gate_up, I2, a->act, a->I, T, a->I);
    else silu_mul_for_bf16(a->gate_up, I2, a->act, a->I, T, a->I);
    project(a, st, l, 3, a->act, a->I, w->down, a->down, H);
    if (w->mlp_out_norm) rms_norm_for_bf16(a->down, H, w->mlp_out_norm, a->down, H, T, H, a->eps);
    if (l + 1 < a->num_layers)
        add_rms_norm_for_bf16(a->x, H, a->down, H, a->layers[l + 1].input_norm, a->h, H, T, H, a->eps);
    return rc;
}

/* The LoRA groups' shapes (as gemm_lora_bf16 checks them) and the largest rank: 0, or gemm_lora's codes. */
static int check_lora(const decoder_args *a, int *max_rank) {
    const int Q = a->heads * a->d, N[NGROUPS] = {Q + 2 * a->kv_heads * a->d, a->H, 2 * a->I, a->H},
              K[NGROUPS] = {a->H, Q, a->H, a->I};
    *max_rank = 0;
    for (int l = 0; a->lora && l < a->num_layers; l++)
        for (int g = 0; g < NGROUPS; g++) {
            const decoder_lora *lo = a->lora + (int64_t)l * NGROUPS + g;
            if (!lo->a) continue;
            const int bad = check_shapes(K[g], N[g], lo->R, lo->G, lo->out);
            if (bad) return bad;
            if (K[g] > MAX_IN) return -1;
            if (a->slot && (int64_t)(lo->R + 1) / 2 * lo->G > a->vp_stride) return -1;
            if (lo->R > *max_rank) *max_rank = lo->R;
        }
    return 0;
}

/* Returns 0; -1 for a shape the kernels do not take (odd H, Q or I; see paired_attention_bf16 and
 * gemm_lora_bf16); -3 a LoRA rank out of range; -2 or -4 when scratch could not be allocated (the outputs
 * are then undefined). */
int decoder_layers_bf16(const decoder_args *a) {
    if (a->H % 2 || a->I % 2 || (a->heads * a->d) % 2 || !attention_shape_ok(a->heads, a->kv_heads, a->d, a->block_size))
        return -1;
    int max_rank;
    const int bad = check_lora(a, &max_rank);
    if (bad) return bad;
    if (a->T <= 0) return 0;
    int64_t *rows = (int64_t *)malloc(sizeof(int64_t) * a->T);
    int *group = (int *)malloc(sizeof(int) * (a->T + 1));
    walker *walkers = (walker *)malloc(sizeof(walker) * omp_get_max_threads());
    if (!rows || !group || !walkers) { free(rows); free(group); free(walkers); return -4; }
    const int nrows = a->lora && a->slot ? adapter_rows(a->slot, a->rank, a->T, max_rank, rows) : 0;
    const int ngroups = nrows > 0 ? row_groups(rows, nrows, a->slot, a->rank, group) : 0;
    int64_t tasks = 0, *task_seg = NULL;
    const int seg_rc = a->lora && a->n_seg > 0 ? segment_tasks(a->seg_start, a->seg_rank, a->n_seg, max_rank, segment_task_tokens(),
                                                              &tasks, &task_seg) : 0;
    if (nrows < 0 || seg_rc) { free(rows); free(group); free(walkers); return nrows < 0 ? nrows : seg_rc; }
    int failed = 0;
#pragma omp parallel
    {
        const int t = omp_get_thread_num(), nth = omp_get_num_threads();
        const step_state st = {rows, nrows, group, ngroups, walkers + t, tasks, task_seg};
        rms_norm_for_bf16(a->x, a->H, a->layers[0].input_norm, a->h, a->H, a->T, a->H, a->eps);
        for (int l = 0; l < a->num_layers; l++) {
            const int rc = layer(a, &st, l, t, nth);
            if (rc) {
#pragma omp atomic write
                failed = rc;
            }
        }
    }
    free(rows);
    free(group);
    free(walkers);
    free(task_seg);
    return failed;
}
#else
int decoder_layers_bf16(const decoder_args *a) {
    (void)a;
    return -3;   /* built without AVX512-BF16: decoder.py never calls it then */
}
#endif
