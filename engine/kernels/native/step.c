/* step.c - every decoder layer of a Llama-family decode step in one call
 *
 * A decode-only step (each of the M rows is the one new token of a different request) ran
 * as ~9 ctypes calls per layer plus torch glue (allocations, views, index_copy_). Here the
 * layer loop is C, and each op is the kernel the Python path calls (add_rms_norm_f32,
 * rope_f32, paged attention, silu_mul_f32) on the same inputs in the same order, the matmuls
 * w4a8n_matmul below (bitwise w4a8_matmul's result from half its weight bytes; a step of many
 * rows, a prompt's chunk, w4a8_matmul on the byte weights), the attention of prompt rows the
 * model gives to bf16 vectors by bf16_attention.c as that path does, and the KV
 * store the new rows as the cache's dtype holds them (put_kv: what .to() and index_copy_ do
 * there): a row's result is bitwise the Python path's. Two schedules, the same result: a parallel region per op
 * (layer), or the whole step on one OpenMP team (team_step, the default).
 *
 * A step may stop at a layer's end: each layer's end but the last reads the step's stop word (an
 * int32 that another thread writes) and the step stops there, its work counting for nothing,
 * when the word is below the step's threshold (engine/core/kv_hooks.py: a more urgent request
 * came). In team_step every thread leaves at the same layer.
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
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_thread_num(void) { return 0; }
static inline int omp_get_num_threads(void) { return 1; }
#endif
#include "kvformat.h"

#define STEP_PTRS 22
#define STEP_BYTES 14 /* the first of the byte weights' pointers */
#define STEP_HALF 18  /* the first of the fp16 scales' pointers */
#define STEP_STOPPED (-4) /* decode_step_llama stopped at a layer's end: nothing it computed counts */

int w4a8_matmul(const float *x, const uint8_t *wq, const float *dw, const float *mw, float *y, int64_t M, int64_t N,
                int64_t K, int nt);
void silu_mul_f32(const float *gu, float *out, int64_t T, int64_t I, int nthreads);
void rope_f32(float *x, int64_t T, int64_t stride, int heads, int hd, const float *cos_t, const float *sin_t,
              const int64_t *positions, int nthreads);
void add_rms_norm_f32(float *h, const float *delta, const float *w, float *out, int64_t T, int64_t D, float eps,
                      int nthreads);
int paged_decode_attention_f32(const float *q, const void *kc, const void *vc, const int64_t *tables,
                               const int64_t *lens, const int64_t *skips, float *out, int B, int H, int KVH, int D,
                               int bs, int max_blocks, float scale, int nthreads, int kv_fmt);

int bf16_prompt_attention(const float *q, const void *kc, const void *vc, const int64_t *tables, const int64_t *lens,
                          float *out, int B, int H, int KVH, int D, int bs, int max_blocks, float scale, int nthreads,
                          int fmt);
int paged_attention_item(const float *q, const void *kc, const void *vc, const int64_t *tables, const int64_t *lens,
                         const int64_t *skips, float *out, int w, int H, int KVH, int D, int bs, int max_blocks,
                         float scale, int kv_fmt);
int paged_attention_row(const float *q, const void *kc, const void *vc, const int64_t *tables, const int64_t *lens,
                        const int64_t *skips, float *out, int b, int H, int KVH, int D, int bs, int max_blocks,
                        float scale, int kv_fmt);

int decode_step_ptrs(void) { return STEP_PTRS; }

#include "step_lora.h"

/* w4a8n.c: Q4_1 x int8 over nibble-packed weights (bitwise w4a8_matmul's result) */
int w4a8n_matmul(const float *x, const uint8_t *wn, const float *dw, const float *mw, float *y, int64_t M, int64_t N,
                 int64_t K, int nt, int hs);
#ifdef __AVX2__
#include <immintrin.h>
void w4a8_quantize_row(const float *x, int64_t K, int8_t *q, float *d, float *s, int row);
void w4a8n_columns(const int8_t *xq, const float *dx, const float *sx, const uint8_t *wn, const float *dw,
                   const float *mw, float *y, int64_t M, int64_t N, int64_t K, int64_t c0, int64_t c1);
void w4a8n_columns_h(const int8_t *xq, const float *dx, const float *sx, const uint8_t *wn, const float *dw,
                     const float *mw, float *y, int64_t M, int64_t N, int64_t K, int64_t c0, int64_t c1);
#endif

/* The model's shape, as engine/kernels/native/step.py fills it (field order matters). */
typedef struct {
    int64_t layers, hidden, heads, kv_heads, head_dim, inter, block_size, max_blocks;
    float eps, scale;
    int64_t max_positions, num_slots; /* the cos/sin tables' rows, the cache's slots: the inputs' bounds */
    int64_t kv_fmt;                   /* the cache's format (kvformat.h): KV_F32, KV_BF16, KV_INT8, KV_FP8 */
    int64_t byte_rows;                /* a step of more rows reads the byte weights (where present) */
    int64_t n_bf16;                   /* ranges of prompt rows that attend in bf16 vectors (bf16_attention.c) */
    const int64_t *bf16_ranges;       /* n_bf16 (start, end) pairs, ascending */
} step_dims;

/* Heads [kh, kh + nh) of a token's new K (or V) row x (nh * hd floats) into its cache slot:
 * copied (fp32), rounded to bf16 as torch's .to(torch.bfloat16) rounds (to nearest, ties to
 * even; NaN as 0x7fc0), bit for bit, or as 8-bit rows with their scales (kv_encode_row). */
static void put_kv(void *cache, int64_t slot, int64_t kh, int64_t nh, const float *x, const step_dims *d) {
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
static int stop_now(const int32_t *stop, int32_t threshold) {
    return stop && __atomic_load_n(stop, __ATOMIC_ACQUIRE) < threshold;
}

/* The step's scratch, one allocation: each buffer is (M, width) fp32. */
typedef struct {
    float *x, *qkv, *q, *att, *a, *gu, *act, *delta;
} step_bufs;

static float *alloc_bufs(step_bufs *b, const step_dims *d, int64_t M) {
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
        put_kv(kc, slots[t], 0, d->kv_heads, row + nq, d);
        put_kv(vc, slots[t], 0, d->kv_heads, row + nq + nk, d);
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

/* One layer: h += delta (the previous layer's MLP output; NULL for the first), attention,
 * h += its output, and the MLP's output into b->delta. Returns 0, or -1 without memory. */
static int layer(const step_dims *d, void *const *w, void *kc, void *vc, float *h, const float *delta,
                 step_bufs *b, const int64_t *positions, const float *cos_t, const float *sin_t,
                 const int64_t *slots, const int64_t *tables, const int64_t *lens, int64_t M, int nt,
                 const step_lora *L, int64_t li) {
    const int64_t H = d->hidden, nq = d->heads * d->head_dim, wqkv = nq + 2 * d->kv_heads * d->head_dim;
    add_rms_norm_f32(h, delta, w[0], b->x, M, H, d->eps, nt);
    if (matmul(d, w, 0, b->x, b->qkv, M, wqkv, H, nt)) return -1;
    if (lora_all(L, li, 0, b->x, H, b->qkv, wqkv, M, nt)) return -1;
    rope_f32(b->qkv, M, wqkv, (int)(d->heads + d->kv_heads), (int)d->head_dim, cos_t, sin_t, positions, nt);
    store_kv(d, b->qkv, b->q, kc, vc, slots, M);
    if (attend(d, b->q, kc, vc, tables, lens, b->att, M, nt)) return -1;
    if (matmul(d, w, 1, b->att, b->a, M, H, nq, nt)) return -1;
    if (lora_all(L, li, 1, b->att, nq, b->a, H, M, nt)) return -1;
    add_rms_norm_f32(h, b->a, w[1], b->x, M, H, d->eps, nt);
    if (matmul(d, w, 2, b->x, b->gu, M, 2 * d->inter, H, nt)) return -1;
    if (lora_all(L, li, 2, b->x, H, b->gu, 2 * d->inter, M, nt)) return -1;
    silu_mul_f32(b->gu, b->act, M, d->inter, nt);
    if (matmul(d, w, 3, b->act, b->delta, M, H, d->inter, nt)) return -1;
    return lora_all(L, li, 3, b->act, d->inter, b->delta, H, M, nt);
}

#ifdef __AVX2__
/* ---- the same step in one parallel region ------------------------------------------------
 * One team for the whole step, 5 barriers a layer (after each matmul and after attention)
 * instead of 5 fork/joins plus the matmuls' inner barriers. What every thread needs whole
 * (the residual stream h, its norm, the quantized activations, SwiGLU's product) each thread
 * computes itself into its own buffers: at decode sizes that is cheaper than a barrier, and
 * it is the same arithmetic, so the result is bitwise the per-op path's. A matmul's columns
 * and attention's items (rows, or (row, KV head) pairs while the rows are few) are split between
 * the threads; an item ropes, stores and attends its own heads (no other item reads its new K/V:
 * each row's new slot is its own). */
typedef struct {
    float *h, *x, *act, *dx; /* (M, hidden) twice, (M, inter), the quantized activations' scales */
    int8_t *xq;
    float *lt; /* max_rank floats: a row's LoRA intermediate */
} team_bufs;

/* x (M, K) into the quantized form w4a8n_columns reads (quads of rows; missing rows zero). */
static void quantize_all(const float *x, int64_t M, int64_t K, team_bufs *p) {
    const int64_t G = K / 32, Mp = (M + 3) / 4 * 4;
    float *sx = p->dx + 2 * Mp * G;
    if (Mp > M) {
        memset(p->xq + (Mp - 4) * K, 0, (size_t)(4 * K));
        memset(p->dx + (Mp - 4) * 2 * G, 0, sizeof(float) * (size_t)(8 * G));
        memset(sx + (Mp - 4) * G, 0, sizeof(float) * (size_t)(4 * G));
    }
    for (int64_t i = 0; i < M; i++)
        w4a8_quantize_row(x + i * K, K, p->xq + i / 4 * 4 * K, p->dx + i / 4 * 8 * G, sx + i / 4 * 4 * G, (int)(i % 4));
}

/* y (M, N) = x @ W.T, matrix m of a layer's pointers w, for this thread's share of the column
 * blocks (over the fp16 scales where given); then the team waits. */
static void team_matmul(const float *x, void *const *w, int m, float *y, int64_t M, int64_t N, int64_t K,
                        team_bufs *p) {
    const int t = omp_get_thread_num(), T = omp_get_num_threads();
    const int64_t G = K / 32, Mp = (M + 3) / 4 * 4, blocks = N / 8, c0 = blocks * t / T, c1 = blocks * (t + 1) / T;
    void *const *q = w + 2 + 3 * m;
    const float *dm = w[STEP_HALF + m];
    quantize_all(x, M, K, p);
#if defined(__F16C__) || defined(__AVX512F__) /* vnni.h's W4A8_HALF_SCALES: step.py gives dm only there */
    if (dm)
        w4a8n_columns_h(p->xq, p->dx, p->dx + 2 * Mp * G, q[0], dm, dm, y, M, N, K, c0, c1);
    else
#endif
        w4a8n_columns(p->xq, p->dx, p->dx + 2 * Mp * G, q[0], q[1], q[2], y, M, N, K, c0, c1);
    (void)dm;
#pragma omp barrier
}

/* The step's LoRA updates of y (M, N) for this thread's share of the columns; then the team
 * waits (nothing when no row has an adapter). */
static void team_lora(const step_lora *L, int64_t li, int m, const float *x, int64_t K, float *y, int64_t N,
                      int64_t M, team_bufs *p) {
    if (!L) return;
    const int t = omp_get_thread_num(), T = omp_get_num_threads();
    lora_cols(L, li, m, x, K, y, N, M, N * t / T, N * (t + 1) / T, p->lt);
#pragma omp barrier
}

/* Row b, KV head kh: RoPE of its G query heads and its K head in place in qkv, the K/V rows
 * into the cache, q into the attention kernel's layout. */
static void team_head_in(const step_dims *d, int64_t b, int64_t kh, float *qkv, float *q, void *kc, void *vc,
                         const int64_t *positions, const float *cos_t, const float *sin_t, const int64_t *slots) {
    const int64_t hd = d->head_dim, KVH = d->kv_heads, G = d->heads / KVH, nq = d->heads * hd, nk = KVH * hd;
    float *row = qkv + b * (nq + 2 * nk), *qh = row + kh * G * hd, *kr = row + nq + kh * hd;
    rope_f32(qh, 1, 0, (int)G, (int)hd, cos_t, sin_t, positions + b, 1);
    rope_f32(kr, 1, 0, 1, (int)hd, cos_t, sin_t, positions + b, 1);
    put_kv(kc, slots[b], kh, 1, kr, d);
    put_kv(vc, slots[b], kh, 1, kr + nk, d);
    memcpy(q + b * nq + kh * G * hd, qh, sizeof(float) * (size_t)(G * hd));
}

/* Attention item w: with `whole_rows`, row w and all its KV heads (paged_attention_row: each
 * block's heads read together); else row w / KVH, KV head w % KVH (items enough for every thread
 * when the rows are few). Either way the same bits (attention.c). */
static int team_item(const step_dims *d, int w, int whole_rows, float *qkv, float *q, float *att, void *kc, void *vc,
                     const int64_t *positions, const float *cos_t, const float *sin_t, const int64_t *slots,
                     const int64_t *tables, const int64_t *lens) {
    const int64_t KVH = d->kv_heads;
    const int H = (int)d->heads, hd = (int)d->head_dim, bs = (int)d->block_size, mb = (int)d->max_blocks;
    if (whole_rows) {
        for (int64_t kh = 0; kh < KVH; kh++) team_head_in(d, w, kh, qkv, q, kc, vc, positions, cos_t, sin_t, slots);
        return paged_attention_row(q, kc, vc, tables, lens, NULL, att, w, H, (int)KVH, hd, bs, mb, d->scale,
                                   (int)d->kv_fmt);
    }
    team_head_in(d, w / KVH, w % KVH, qkv, q, kc, vc, positions, cos_t, sin_t, slots);
    return paged_attention_item(q, kc, vc, tables, lens, NULL, att, w, H, (int)KVH, hd, bs, mb, d->scale,
                                (int)d->kv_fmt);
}

/* One layer on the team (layer()'s steps); `delta` is the shared previous MLP output. */
static int team_layer(const step_dims *d, void *const *w, void *kc, void *vc, step_bufs *s, team_bufs *p,
                      int first, const int64_t *positions, const float *cos_t, const float *sin_t,
                      const int64_t *slots, const int64_t *tables, const int64_t *lens, int64_t M,
                      const step_lora *L, int64_t li) {
    const int64_t H = d->hidden, nq = d->heads * d->head_dim, wqkv = nq + 2 * d->kv_heads * d->head_dim;
    int failed = 0;
    add_rms_norm_f32(p->h, first ? NULL : s->delta, w[0], p->x, M, H, d->eps, 1);
    team_matmul(p->x, w, 0, s->qkv, M, wqkv, H, p);
    team_lora(L, li, 0, p->x, H, s->qkv, wqkv, M, p);
    /* whole rows once every thread has two: a row's heads share its blocks' cache lines */
    const int T = omp_get_num_threads(), whole = T == 1 || M >= 2 * T;
#pragma omp for schedule(dynamic, 1)
    for (int it = 0; it < (int)(whole ? M : M * d->kv_heads); it++)
        failed |= team_item(d, it, whole, s->qkv, s->q, s->att, kc, vc, positions, cos_t, sin_t, slots, tables, lens);
    team_matmul(s->att, w, 1, s->a, M, H, nq, p);
    team_lora(L, li, 1, s->att, nq, s->a, H, M, p);
    add_rms_norm_f32(p->h, s->a, w[1], p->x, M, H, d->eps, 1);
    team_matmul(p->x, w, 2, s->gu, M, 2 * d->inter, H, p);
    team_lora(L, li, 2, p->x, H, s->gu, 2 * d->inter, M, p);
    silu_mul_f32(s->gu, p->act, M, d->inter, 1);
    team_matmul(p->act, w, 3, s->delta, M, H, d->inter, p);
    team_lora(L, li, 3, p->act, d->inter, s->delta, H, M, p);
    return failed;
}

/* decode_step_llama's work on one team; returns 0, -1 without memory, or STEP_STOPPED. At a
 * layer's end (not the last) one thread reads the stop word for the team, and every thread
 * leaves the layer loop there or none does. */
static int team_step(const step_dims *d, void *const *weights, void *const *kv, const float *final_w, float *h,
                     float *out, step_bufs *s, const int64_t *positions, const float *cos_t, const float *sin_t,
                     const int64_t *slots, const int64_t *tables, const int64_t *lens, int64_t M, int nt,
                     const step_lora *L, const int32_t *stop, int32_t threshold) {
    const int64_t H = d->hidden, Mp = (M + 3) / 4 * 4, nq = d->heads * d->head_dim;
    const int64_t kmax = H > nq ? (H > d->inter ? H : d->inter) : (nq > d->inter ? nq : d->inter);
    const size_t floats = (size_t)(2 * M * H + M * d->inter + Mp * (kmax / 32) * 3), bytes = (size_t)(Mp * kmax);
    const size_t lfloats = L && L->max_rank > 0 ? (size_t)L->max_rank : 0;
    const size_t per = ((floats + lfloats) * sizeof(float) + bytes + 63) & ~(size_t)63;
    char *all = aligned_alloc(64, per * (size_t)nt);
    int failed = 0, stopped = 0;
    if (!all) return -1;
#pragma omp parallel num_threads(nt) reduction(| : failed)
    {
        char *mine = all + per * (size_t)omp_get_thread_num();
        team_bufs p = {(float *)mine, (float *)mine + M * H, (float *)mine + 2 * M * H,
                       (float *)mine + 2 * M * H + M * d->inter, (int8_t *)(mine + floats * sizeof(float)),
                       (float *)(mine + floats * sizeof(float) + bytes)};
        memcpy(p.h, h, sizeof(float) * (size_t)(M * H));
        for (int64_t i = 0; i < d->layers; i++) {
            failed |= team_layer(d, weights + i * STEP_PTRS, kv[2 * i], kv[2 * i + 1], s, &p, i == 0, positions,
                                 cos_t, sin_t, slots, tables, lens, M, L, i);
            if (stop && i + 1 < d->layers) { /* the layer ended in a barrier: the team is here */
#pragma omp single
                stopped = stop_now(stop, threshold);
                if (stopped) /* read after the single's barrier; written again only after the next layer's */
                    break;
            }
        }
        if (!stopped && omp_get_thread_num() == 0) {
            add_rms_norm_f32(p.h, s->delta, final_w, out, M, H, d->eps, 1);
            memcpy(h, p.h, sizeof(float) * (size_t)(M * H));
        }
    }
    free(all);
    return failed ? -1 : stopped ? STEP_STOPPED : 0;
}
#endif

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
 *   one_region          1: the whole step on one OpenMP team (team_step; decode rows only, no bf16
 *                       ranges), 0: each op its own region
 *   lora                the rows' LoRA adapters (step_lora above), or NULL
 *   stop, threshold     the stop word (NULL: the step never stops), read at each layer's end
 *                       but the last: the step stops there when it is below `threshold`
 * Returns 0, -1 when scratch memory could not be allocated, -2 (nothing run) when a position
 * or slot lies outside the tables or the cache, -3 (nothing run) for a cache format not in
 * kvformat.h, or STEP_STOPPED (-4) when it stopped: `out` is not written, `h` and the
 * cache's new slots hold partial results (the layers it ran), which count for nothing. */
int decode_step_llama(const step_dims *d, void *const *weights, void *const *kv, const float *final_w, float *h,
                      float *out, const int64_t *positions, const float *cos_t, const float *sin_t,
                      const int64_t *slots, const int64_t *tables, const int64_t *lens, int64_t M, int nt,
                      int one_region, const step_lora *lora, const int32_t *stop, int32_t threshold) {
    if (M <= 0) return 0;
    if (d->kv_fmt < KV_F32 || d->kv_fmt > KV_FP8) return -3;
    for (int64_t i = 0; i < M; i++) /* checked here: in torch ops this cost 0.5 ms a step */
        if (positions[i] < 0 || positions[i] >= d->max_positions || slots[i] < 0 || slots[i] >= d->num_slots)
            return -2;
    step_bufs b;
    float *base = alloc_bufs(&b, d, M);
    if (!base) return -1;
    int rc = 0;
#ifdef __AVX2__
    if (one_region && !d->n_bf16) {
        rc = team_step(d, weights, kv, final_w, h, out, &b, positions, cos_t, sin_t, slots, tables, lens, M,
                       nt < 1 ? 1 : nt, lora, stop, threshold);
        free(base);
        return rc;
    }
#endif
    for (int64_t i = 0; i < d->layers && !rc; i++) {
        rc = layer(d, weights + i * STEP_PTRS, kv[2 * i], kv[2 * i + 1], h, i ? b.delta : NULL, &b, positions, cos_t,
                   sin_t, slots, tables, lens, M, nt, lora, i);
        if (!rc && i + 1 < d->layers && stop_now(stop, threshold)) rc = STEP_STOPPED;
    }
    if (!rc) add_rms_norm_f32(h, b.delta, final_w, out, M, d->hidden, d->eps, nt);
    free(base);
    return rc;
}
