/* step_team.c - step.c's step on one OpenMP team (decode_step_llama's one_region 1): the rows of
 * a small decode step, every op's work split between the threads of one parallel region. */
#include "step.h"

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
    step_put_kv(kc, slots[b], kh, 1, kr, d);
    step_put_kv(vc, slots[b], kh, 1, kr + nk, d);
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
int step_team(const step_dims *d, void *const *weights, void *const *kv, const float *final_w, float *h,
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
                stopped = step_stop_now(stop, threshold);
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
