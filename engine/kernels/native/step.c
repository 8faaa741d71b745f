/* step.c - every decoder layer of a Llama-family decode step in one call
 *
 * A decode-only step (each of the M rows is the one new token of a different request) ran
 * as ~9 ctypes calls per layer plus torch glue (allocations, views, index_copy_). Here the
 * layer loop is C, and each op is the kernel the Python path calls (add_rms_norm_f32,
 * rope_f32, paged attention, silu_mul_f32) on the same inputs in the same order, the matmuls
 * w4a8n_matmul below (bitwise w4a8_matmul's result from half its weight bytes; a step of many
 * rows, a prompt's chunk, w4a8_matmul on the byte weights), the attention of prompt rows the
 * model gives to bf16 vectors by bf16_attention.c as that path does, and the KV
 * store the new rows as the cache's dtype holds them (step_put_kv: what .to() and index_copy_ do
 * there): a row's result is bitwise the Python path's. Three schedules, the same result: a
 * parallel region per op (layer); a decode step's rows split between the threads, each part
 * through every layer on one thread alone (step_split.c, the default above 4 rows); or the whole
 * step on one OpenMP team (step_team.c, the default up to 4 rows).
 *
 * A step may stop at a layer's end: each layer's end but the last reads the step's stop word (an
 * int32 that another thread writes) and the step stops there, its work counting for nothing,
 * when the word is below the step's threshold (engine/core/kv_hooks.py: a more urgent request
 * came). On one team every thread leaves at the same layer; split, each part where it reads it.
 *
 * LoRA adapters (lora.c) add their updates to the four matrices' outputs, per row, where the
 * Python path adds them (before RoPE, before SwiGLU), with the routine that path calls.
 *
 * The common case only: no q/k/v bias, no qk-norm, no sliding window, no query scale,
 * SwiGLU, a paged KV cache in fp32, bf16 or 8-bit codes (int8, fp8), W4A8 weights (w4a8.c's layout) for all four matrices;
 * engine/model/native_step.py checks a model once and falls back otherwise.
 *
 * Per-layer pointers (engine/kernels/native/step.py builds them once per model), STEP_PTRS
 * of them per layer, in this order:
 *   input norm weight, post-attention norm weight,
 *   qkv q/d/m, o q/d/m, gate_up q/d/m, down q/d/m (w4a8.pack's d, m and its q as nibbles, below),
 *   qkv, o, gate_up, down q as w4a8.pack lays it out, a byte a weight (or NULL: the nibbles serve)
 *   qkv, o, gate_up, down d and m in fp16 (w4a8n.c's dm), which the nibbles' matmuls read
 *   instead of the fp32 ones (or NULL: a model whose scales are not all fp16 values)
 *   K cache, V cache (num_blocks, bs, KVH, hd) fp32 or bf16, or (num_blocks, bs, KVH, hd + 4)
 *   8-bit rows and their scales, in a second array (per KV cache)
 */
#include "step.h"

int decode_step_ptrs(void) { return STEP_PTRS; }

/* The threads the last op of this process's latest step with a region per op ran on (its
 * hook may change them midway): for tests. */
static int last_threads;
int decode_step_last_threads(void) { return __atomic_load_n(&last_threads, __ATOMIC_RELAXED); }

/* Heads [kh, kh + nh) of a token's new K (or V) row x (nh * hd floats) into its cache slot:
 * copied (fp32), rounded to bf16 as torch's .to(torch.bfloat16) rounds (to nearest, ties to
 * even; NaN as 0x7fc0), bit for bit, or as 8-bit rows with their scales (kv_encode_row). */
void step_put_kv(void *cache, int64_t slot, int64_t kh, int64_t nh, const float *x, const step_dims *d) {
    const int64_t hd = d->head_dim, fmt = d->kv_fmt, first = slot * d->kv_heads + kh;
    if (fmt == KV_F32) {
        memcpy((float *)cache + first * hd, x, sizeof(float) * (size_t)(nh * hd));
        return;
    }
    if (fmt >= KV_INT8) {
        for (int64_t j = 0; j < nh; j++)
            kv_encode_row(x + j * hd, (uint8_t *)cache + (first + j) * (int64_t)head_row_bytes((int)fmt, (int)hd),
                          (int)hd, (int)fmt);
        return;
    }
    uint16_t *o = (uint16_t *)cache + first * hd;
    for (int64_t i = 0; i < nh * hd; i++) {
        uint32_t u;
        memcpy(&u, x + i, 4);
        o[i] = (u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0 : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
}

/* Whether the step stops at this layer's end: its stop word (NULL: none), which another thread
 * may write at any time, is below the step's threshold. */
int step_stop_now(const int32_t *stop, int32_t threshold) {
    return stop && __atomic_load_n(stop, __ATOMIC_ACQUIRE) < threshold;
}


float *step_alloc_bufs(step_bufs *b, const step_dims *d, int64_t M) {
    const int64_t H = d->hidden, nq = d->heads * d->head_dim, wqkv = nq + 2 * d->kv_heads * d->head_dim;
    const int64_t widths[8] = {H, wqkv, nq, nq, H, 2 * d->inter, d->inter, H};
    int64_t total = 0;
    for (int i = 0; i < 8; i++) total += M * widths[i];
    float *base = malloc(sizeof(float) * (size_t)total), *p = base;
    if (!base) return NULL;
    float **slots[8] = {&b->x, &b->qkv, &b->q, &b->att, &b->a, &b->gu, &b->act, &b->delta};
    for (int i = 0; i < 8; i++) {
        *slots[i] = p;
        p += M * widths[i];
    }
    return base;
}

/* The new K and V rows (after RoPE, in the fused qkv rows) into their cache slots, and q
 * into its own contiguous (M, heads, hd) buffer, as the attention kernel reads it. */
static void store_kv(const step_dims *d, const float *qkv, float *q, void *kc, void *vc, const int64_t *slots,
                     int64_t M) {
    const int64_t nq = d->heads * d->head_dim, nk = d->kv_heads * d->head_dim, wqkv = nq + 2 * nk;
    for (int64_t t = 0; t < M; t++) {
        const float *row = qkv + t * wqkv;
        memcpy(q + t * nq, row, sizeof(float) * (size_t)nq);
        step_put_kv(kc, slots[t], 0, d->kv_heads, row + nq, d);
        step_put_kv(vc, slots[t], 0, d->kv_heads, row + nq + nk, d);
    }
}

/* y (M, N) = x (M, K) @ matrix m (0 qkv, 1 o, 2 gate_up, 3 down) of a layer's pointers w: over
 * its nibbles (with its fp16 scales where given), or past byte_rows rows over its byte weights,
 * which the arithmetic-bound step reads faster than it unpacks nibbles (the same bits either way). */
static int matmul(const step_dims *d, void *const *w, int m, const float *x, float *y, int64_t M, int64_t N, int64_t K,
                  int nt) {
    void *const *q = w + 2 + 3 * m;
    const float *dm = w[STEP_HALF + m];
    if (M > d->byte_rows && w[STEP_BYTES + m]) return w4a8_matmul(x, w[STEP_BYTES + m], q[1], q[2], y, M, N, K, nt);
    return dm ? w4a8n_matmul(x, q[0], dm, dm, y, M, N, K, nt, 1) : w4a8n_matmul(x, q[0], q[1], q[2], y, M, N, K, nt, 0);
}

/* The step's attention: the rows of d->bf16_ranges in bf16 vectors (where the kernel takes
 * them, else as the others), the others by the fp32 kernel, range by range as the Python path
 * calls them (engine/kernels/attention.py `_forward_bf16_prompts`). Returns 0 or -1. */
static int attend(const step_dims *d, const float *q, const void *kc, const void *vc, const int64_t *tables,
                  const int64_t *lens, float *att, int64_t M, int nt) {
    const int H = (int)d->heads, KVH = (int)d->kv_heads, hd = (int)d->head_dim, bs = (int)d->block_size;
    const int mb = (int)d->max_blocks, fmt = (int)d->kv_fmt;
    const int64_t w = (int64_t)H * hd;
    int64_t at = 0;
    for (int64_t r = 0; r <= d->n_bf16; r++) {
        const int64_t lo = r < d->n_bf16 ? d->bf16_ranges[2 * r] : M, hi = r < d->n_bf16 ? d->bf16_ranges[2 * r + 1] : M;
        if (at < lo && paged_decode_attention_f32(q + at * w, kc, vc, tables + at * mb, lens + at, NULL, att + at * w,
                                                  (int)(lo - at), H, KVH, hd, bs, mb, d->scale, nt, fmt))
            return -1;
        if (lo < hi) {
            const int rc = bf16_prompt_attention(q + lo * w, kc, vc, tables + lo * mb, lens + lo, att + lo * w,
                                                 (int)(hi - lo), H, KVH, hd, bs, mb, d->scale, nt, fmt);
            if (rc == -2 ? paged_decode_attention_f32(q + lo * w, kc, vc, tables + lo * mb, lens + lo, NULL,
                                                      att + lo * w, (int)(hi - lo), H, KVH, hd, bs, mb, d->scale, nt,
                                                      fmt)
                         : rc)
                return -1;
        }
        at = hi;
    }
    return 0;
}

/* The threads a step goes on with after its hook answered `said` (step_hook): -1 to stop,
 * else `said` if positive, else `nt`. */
static inline int step_threads(int said, int nt) { return said < 0 ? -1 : said > 0 ? said : nt; }

/* One layer: h += delta (the previous layer's MLP output; NULL for the first), attention,
 * h += its output, and the MLP's output into b->delta; `hook` (or NULL) called at the pause
 * points inside it, whose thread counts the layer's later ops take. Returns 0, -1 without
 * memory, or STEP_STOPPED (the hook said so). */
int step_layer(const step_dims *d, void *const *w, void *kc, void *vc, float *h, const float *delta, step_bufs *b,
               const int64_t *positions, const float *cos_t, const float *sin_t, const int64_t *slots,
               const int64_t *tables, const int64_t *lens, int64_t M, int nt, const step_lora *L, int64_t li,
               step_hook hook) {
    const int64_t H = d->hidden, nq = d->heads * d->head_dim, wqkv = nq + 2 * d->kv_heads * d->head_dim;
    add_rms_norm_f32(h, delta, w[0], b->x, M, H, d->eps, nt);
    if (matmul(d, w, 0, b->x, b->qkv, M, wqkv, H, nt)) return -1;
    if (lora_all(L, li, 0, b->x, H, b->qkv, wqkv, M, nt)) return -1;
    rope_f32(b->qkv, M, wqkv, (int)(d->heads + d->kv_heads), (int)d->head_dim, cos_t, sin_t, positions, nt);
    store_kv(d, b->qkv, b->q, kc, vc, slots, M);
    if (attend(d, b->q, kc, vc, tables, lens, b->att, M, nt)) return -1;
    if (matmul(d, w, 1, b->att, b->a, M, H, nq, nt)) return -1;
    if (lora_all(L, li, 1, b->att, nq, b->a, H, M, nt)) return -1;
    if (hook && (nt = step_threads(hook(li, 1), nt)) < 0) return STEP_STOPPED;
    add_rms_norm_f32(h, b->a, w[1], b->x, M, H, d->eps, nt);
    if (matmul(d, w, 2, b->x, b->gu, M, 2 * d->inter, H, nt)) return -1;
    if (lora_all(L, li, 2, b->x, H, b->gu, 2 * d->inter, M, nt)) return -1;
    if (hook && (nt = step_threads(hook(li, 2), nt)) < 0) return STEP_STOPPED;
    silu_mul_f32(b->gu, b->act, M, d->inter, nt);
    if (matmul(d, w, 3, b->act, b->delta, M, H, d->inter, nt)) return -1;
    return lora_all(L, li, 3, b->act, d->inter, b->delta, H, M, nt);
}

/* All layers of a step (decode rows, and prompt rows in runs of consecutive positions), then
 * the final norm:
 *   h (M, hidden)       the residual stream into the first layer (the embeddings, or a pipeline
 *                       stage's input) in; the stream after the last layer (its MLP's output added) out
 *   out (M, hidden)     the final normed hidden states
 *   weights             layers * STEP_PTRS pointers (above); kv: layers * 2 (K, V)
 *   positions (M,)      int64, inside the cos/sin tables (max_positions, head_dim)
 *   slots (M,)          int64 flat cache slots of the new tokens
 *   tables (M, max_blocks), lens (M,) int64: each row's blocks and context length, checked
 *                       (native.paged_attention_tables)
 *   one_region          1: the whole step on one OpenMP team (step_team; decode rows only, no
 *                       bf16 ranges), 2: the rows split between the threads (step_split.c; the same),
 *                       3: split, every row starting on the first thread (the hand-over path),
 *                       0: each op its own region
 *   lora                the rows' LoRA adapters (step_lora above), or NULL
 *   stop, threshold     the stop word (NULL: the step never stops), read at each layer's end
 *                       but the last: the step stops there when it is below `threshold`
 *   hook                called at each pause point (step_hook; one_region 0 only), or NULL:
 *                       the caller's layer hook (KV streamed out, a pause for a peer's step)
 * Returns 0, -1 when scratch memory could not be allocated, -2 (nothing run) when a position
 * or slot lies outside the tables or the cache, -3 (nothing run) for a cache format not in
 * kvformat.h, or STEP_STOPPED (-4) when it stopped: `out` is not written, `h` and the
 * cache's new slots hold partial results (the layers it ran), which count for nothing. */
int decode_step_llama(const step_dims *d, void *const *weights, void *const *kv, const float *final_w, float *h,
                      float *out, const int64_t *positions, const float *cos_t, const float *sin_t,
                      const int64_t *slots, const int64_t *tables, const int64_t *lens, int64_t M, int nt,
                      int one_region, const step_lora *lora, const int32_t *stop, int32_t threshold,
                      step_hook hook) {
    if (M <= 0) return 0;
    if (d->kv_fmt < KV_F32 || d->kv_fmt > KV_FP8) return -3;
    for (int64_t i = 0; i < M; i++) /* checked here: in torch ops this cost 0.5 ms a step */
        if (positions[i] < 0 || positions[i] >= d->max_positions || slots[i] < 0 || slots[i] >= d->num_slots)
            return -2;
    if (hook) one_region = 0; /* its points are the per-op loop's */
    if ((one_region == 2 || one_region == 3) && !d->n_bf16 && nt > 1)
        return step_split(d, weights, kv, final_w, h, out, positions, cos_t, sin_t, slots, tables, lens, M, nt, lora,
                          stop, threshold, one_region == 3);
    step_bufs b;
    float *base = step_alloc_bufs(&b, d, M);
    if (!base) return -1;
    int rc = 0;
#ifdef __AVX2__
    if (one_region == 1 && !d->n_bf16) {
        rc = step_team(d, weights, kv, final_w, h, out, &b, positions, cos_t, sin_t, slots, tables, lens, M,
                       nt < 1 ? 1 : nt, lora, stop, threshold);
        free(base);
        return rc;
    }
#endif
    for (int64_t i = 0; i < d->layers && !rc; i++) {
        rc = step_layer(d, weights + i * STEP_PTRS, kv[2 * i], kv[2 * i + 1], h, i ? b.delta : NULL, &b, positions, cos_t,
                        sin_t, slots, tables, lens, M, nt, lora, i, hook);
        if (!rc && hook && (nt = step_threads(hook(i, 0), nt)) < 0) rc = STEP_STOPPED;
        if (!rc && i + 1 < d->layers && step_stop_now(stop, threshold)) rc = STEP_STOPPED;
    }
    if (!rc) add_rms_norm_f32(h, b.delta, final_w, out, M, d->hidden, d->eps, nt);
    if (!rc) __atomic_store_n(&last_threads, nt, __ATOMIC_RELAXED);
    free(base);
    return rc;
}
