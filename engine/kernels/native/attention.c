/* Paged decode attention on the CPU, fp32: one query per sequence attends over its cached
 * K/V read in place from the paged cache (no gather into a dense copy first, which at 32
 * streams moved as many bytes per step as the weights).
 *
 * Layouts (all contiguous):
 *   q      (B, H, D)                      the decode rows' queries, after RoPE
 *   kc, vc (num_blocks, bs, KVH, W)       one layer's paged K and V in format `fmt`: KV_F32,
 *                                         KV_BF16 (the upper half of an fp32, converted as
 *                                         read), or 8-bit codes KV_INT8 / KV_FP8 (e4m3), each
 *                                         (token, head) row D codes then its fp32 scale
 *                                         (engine/kv/formats.py, kvformat.h)
 *   tables (B, max_blocks) int64          block ids of each sequence
 *   lens   (B,) int64                     tokens in context, including the new one
 *   skips  (B,) int64 or NULL             keys at the head of each table that the row does not
 *                                         see (a sliding window starting inside its first block)
 *   out    (B, H, D)
 * GQA: query head h reads KV head h / (H / KVH). This file is the one-row kernel; the entry point
 * paged_decode_attention_f32 (attention_rows.c) runs it, or the multi-row kernel for runs of a
 * prompt's rows. Work items are (sequence, KV head) pairs (paged_attention_item), or whole
 * sequences where there are enough for every thread (paged_attention_row); either way the G =
 * H / KVH query heads sharing a KV head read each K/V row from memory once (the later heads of
 * the group find it in L1), and a row's result is the same bits.
 * Two passes per item: scores for every cached token (K read once), then softmax, then the
 * weighted sum of V (V read once). An 8-bit cache's rows are decoded and scaled block by block
 * into an fp32 buffer shared by the group's heads, then attended as fp32: the result is bitwise
 * the fp32 kernel's over the decoded cache. A bf16 cache's rows are likewise widened, or where the
 * build has bf16 vectors (attend.h ATTEND_BF16) read in place by `vdpbf16ps`. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "attend.h"

static inline float dot_f32(const float *a, const float *b, int n) {
    int i = 0;
    float s = 0.f;
#ifdef __AVX2__
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    }
    __m256 acc = _mm256_add_ps(acc0, acc1);
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    lo = _mm_hadd_ps(lo, lo);
    lo = _mm_hadd_ps(lo, lo);
    s = _mm_cvtss_f32(lo);
#endif
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline void axpy_f32(float *y, float a, const float *x, int n) {
    int i = 0;
#ifdef __AVX2__
    __m256 va = _mm256_set1_ps(a);
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#endif
    for (; i < n; i++) y[i] += a * x[i];
}

/* A float-format row's dot product with q (8-bit rows are decoded first: generic_rows). */
static inline float dot_kv(const float *q, const char *k, int n, int fmt) {
    if (fmt == KV_F32) return dot_f32(q, (const float *)k, n);
    float s = 0.f;
    for (int i = 0; i < n; i++) s += q[i] * kv_at(k, i, fmt);
    return s;
}

#ifdef __AVX2__
/* The n rows (token stride `row` bytes) of one block's KV head, decoded and scaled, into buf (n, 64). */
static inline void decode_rows_d64(const char *rows, size_t row, int n, float *buf, const int fmt) {
    const float unit = kv8_unit(fmt);
    for (int t = 0; t < n; t++) {
        const char *r = rows + t * row;
        const __m256 sc = _mm256_set1_ps(row_scale(r, fmt, 64) * unit);
        for (int c = 0; c < 8; c++) _mm256_storeu_ps(buf + t * 64 + 8 * c, _mm256_mul_ps(kv8(r + 8 * c, fmt), sc));
    }
}

/* A row's blocks lie anywhere in the pool, so the hardware's streams end at each block's edge,
 * and one core's reads waited on memory (2 rows x 2,048 keys: 5 GB/s, where a streaming sum reads
 * 14 GB/s). So the blocks are fetched ahead of their use, in the row's order of use (its K blocks,
 * then its V blocks): a whole row's heads (one contiguous stretch a block) the next block, a
 * (row, KV head) item (one head's slice of each token's row) PDSERVE_ITEM_AHEAD blocks ahead.
 * PDSERVE_PREFETCH_L2 (set for AMD CPUs, cpu.py `prefetch_l2`) fetches into L2 rather than
 * L1: on a 2-core Zen 4, 32 rows x 300 keys (bf16) 22 -> 14-16 ms for 30 layers, and the items
 * of one row at 2,048 keys, unfetched before, 6.7-7.2 -> 2.9-3.3 ms; L1 fetches for the items
 * gained there 1.1x. Elsewhere (Intel, where the L1 fetches were measured) as before. */
#ifdef PDSERVE_PREFETCH_L2
#define KV_HINT _MM_HINT_T1
#define PDSERVE_ITEM_AHEAD 2
#else
#define KV_HINT _MM_HINT_T0
#define PDSERVE_ITEM_AHEAD 0
#endif

/* Item i of the fetch order (K blocks 0..nblk-1, then V blocks) for heads at byte offset `off`,
 * `bytes` of each token's `row` (all of it: the block is one stretch). Inlined where it is used:
 * as a function of its own, GCC found a prefetch loop free of effects and dropped its calls. */
static inline __attribute__((always_inline)) void prefetch_item(const char *kc, const char *vc, const int64_t *table,
                                                               int64_t nblk, int64_t i, size_t blk, size_t row,
                                                               size_t off, size_t bytes, int bs) {
    if (i >= 2 * nblk) return;
    const char *p = (i < nblk ? kc + (size_t)table[i] * blk : vc + (size_t)table[i - nblk] * blk) + off;
    if (bytes == row) {
        for (size_t o = 0; o < blk; o += 64) _mm_prefetch(p + o, KV_HINT);
        return;
    }
    for (int t = 0; t < bs; t++)
        for (size_t o = 0; o < bytes; o += 64) _mm_prefetch(p + (size_t)t * row + o, KV_HINT);
}

/* One block's first n rows of a KV head as the block functions read them (READ_FMT), in any
 * format: 8-bit codes decoded and scaled into buf as fp32 rows, float ones as attend.h's as_read. */
static inline __attribute__((always_inline)) const char *block_read(const char *rows, size_t row, int n, const int fmt,
                                                                   float *buf, size_t *stride) {
    if (fmt == KV_F32 || fmt == KV_BF16) return as_read(rows, row, n, fmt, buf, stride);
    decode_rows_d64(rows, row, n, buf, fmt);
    *stride = 64 * sizeof(float);
    return (const char *)buf;
}

/* D = 64 (SmolLM2, Llama-style small models) in any cache format, KV heads [kh0, kh1) of one
 * row (q and out start at head kh0 * G): `inline` with a constant fmt lets the compiler unroll
 * the chunk loops. Blocks outside, each KV head's G query heads inside: a block's K (then V)
 * rows are read from memory once, widened to fp32 once for the G heads (block_read), and found
 * in L1 by them (head by head over the whole context, they came from L2: 1.2x slower at 320
 * tokens). The blocks ahead are fetched meanwhile (prefetch_item; for a whole row's heads,
 * `ahead`, on one Xeon core at 2,048 keys x 4 rows and 300 x 32: 1.3-1.7x faster than head by
 * head; the widening once per KV head 1.15x more). Each head's sums run
 * in the per-block order of attend.h, which the multi-row kernel (attention_rows.c) also runs:
 * a row gets the same bits from any of them. scores: heads * len floats, acc: heads * 64,
 * buf: bs * 64. */
static inline __attribute__((always_inline)) void attend_heads_d64(const float *q, const char *kc, const char *vc,
                                                                  const int64_t *table, int64_t len, int64_t skip,
                                                                  float *out, int G, int KVH, int kh0, int kh1, int bs,
                                                                  float scale, float *scores, float *acc, float *buf,
                                                                  const int fmt, int ahead) {
    enum { D = 64 };
    const size_t hrow = head_row_bytes(fmt, D), row = (size_t)KVH * hrow, blk = (size_t)bs * row;
    const int64_t nblk = (len + bs - 1) / bs;
    const int H = G * (kh1 - kh0), dist = ahead ? 1 : PDSERVE_ITEM_AHEAD;
    const size_t off = (size_t)kh0 * hrow, bytes = (size_t)(kh1 - kh0) * hrow;
    for (int64_t i = 1; i < dist; i++) prefetch_item(kc, vc, table, nblk, i, blk, row, off, bytes, bs);
    avec qs[H * QV_N]; /* each head's query as the blocks read it, once */
    for (int h = 0; h < H; h++) query_d64(q + h * D, scale, qs + h * QV_N, READ_FMT(fmt));
    for (int64_t b = 0; b < nblk; b++) {
        const int n = (int)((b + 1) * bs <= len ? bs : len - b * bs);
        if (dist) prefetch_item(kc, vc, table, nblk, b + dist, blk, row, off, bytes, bs);
        for (int kh = kh0; kh < kh1; kh++) {
            size_t stride;
            const char *kb = block_read(kc + (size_t)table[b] * blk + kh * hrow, row, n, fmt, buf, &stride);
            for (int h = (kh - kh0) * G; h < (kh - kh0 + 1) * G; h++) {
                block_scores_d64(qs + h * QV_N, kb, stride, n, scores + (size_t)h * len + b * bs, READ_FMT(fmt));
            }
        }
    }
    float sum[H];
    for (int h = 0; h < H; h++) {
        mask_head(scores + (size_t)h * len, skip);
        sum[h] = softmax_numerators(scores + (size_t)h * len, len);
    }
    memset(acc, 0, sizeof(float) * (size_t)H * D);
    for (int64_t b = 0; b < nblk; b++) {
        const int n = (int)((b + 1) * bs <= len ? bs : len - b * bs);
        if (dist) prefetch_item(kc, vc, table, nblk, nblk + b + dist, blk, row, off, bytes, bs);
        for (int kh = kh0; kh < kh1; kh++) {
            size_t stride;
            const char *vb = block_read(vc + (size_t)table[b] * blk + kh * hrow, row, n, fmt, buf, &stride);
            for (int h = (kh - kh0) * G; h < (kh - kh0 + 1) * G; h++) {
                avec a[AV_C];
                load_d64(acc + h * D, a);
                block_values_d64(a, scores + (size_t)h * len + b * bs, vb, stride, n, READ_FMT(fmt));
                store_d64(a, acc + h * D);
            }
        }
    }
    for (int h = 0; h < H; h++) {
        avec a[AV_C];
        load_d64(acc + h * D, a);
        head_out_d64(a, sum[h], out + h * D, READ_FMT(fmt));
    }
}

/* attend_heads_d64 with the cache format a constant (one unrolled copy per format). */
static void attend_d64(const float *q, const char *kc, const char *vc, const int64_t *table, int64_t len,
                       int64_t skip, float *out, int G, int KVH, int kh0, int kh1, int bs, float scale, float *scores,
                       float *acc, float *buf, int fmt, int ahead) {
    if (fmt == KV_F32)
        attend_heads_d64(q, kc, vc, table, len, skip, out, G, KVH, kh0, kh1, bs, scale, scores, acc, buf, KV_F32, ahead);
    else if (fmt == KV_BF16)
        attend_heads_d64(q, kc, vc, table, len, skip, out, G, KVH, kh0, kh1, bs, scale, scores, acc, buf, KV_BF16, ahead);
    else if (fmt == KV_INT8)
        attend_heads_d64(q, kc, vc, table, len, skip, out, G, KVH, kh0, kh1, bs, scale, scores, acc, buf, KV_INT8, ahead);
    else
        attend_heads_d64(q, kc, vc, table, len, skip, out, G, KVH, kh0, kh1, bs, scale, scores, acc, buf, KV_FP8, ahead);
}
#endif

/* Rows [0, n) of one block's KV head for attend_generic: in place (fp32, bf16), or decoded and
 * scaled into buf (8-bit: then attended as fp32, the arithmetic of the fp32 kernel). */
static inline const char *generic_rows(const char *rows, size_t row, int n, int D, int fmt, float *buf, size_t *stride,
                                       int *as_fmt) {
    if (fmt < KV_INT8) {
        *stride = row, *as_fmt = fmt;
        return rows;
    }
    for (int t = 0; t < n; t++) {
        const char *r = rows + t * row;
        const float sc = row_scale(r, fmt, D);
        for (int i = 0; i < D; i++) buf[(size_t)t * D + i] = kv_at(r, i, fmt) * sc;
    }
    *stride = (size_t)D * 4, *as_fmt = KV_F32;
    return (const char *)buf;
}

static void attend_generic(const float *q, const char *kc, const char *vc, const int64_t *table, int64_t len,
                           int64_t skip, float *out, int G, int KVH, int kh, int D, int bs, float scale,
                           float *scores, float *acc, float *buf, int fmt) {
    const size_t hrow = head_row_bytes(fmt, D), row = (size_t)KVH * hrow; /* bytes between tokens of a block */
    int64_t nblk = (len + bs - 1) / bs;
    size_t stride;
    int f;
    for (int64_t b = 0; b < nblk; b++) {
        int n = (int)((b + 1) * bs <= len ? bs : len - b * bs);
        const char *kb = generic_rows(kc + ((size_t)table[b] * bs * KVH + kh) * hrow, row, n, D, fmt, buf, &stride, &f);
        for (int t = 0; t < n; t++)
            for (int g = 0; g < G; g++)
                scores[(size_t)g * len + b * bs + t] = dot_kv(q + (size_t)g * D, kb + t * stride, D, f) * scale;
    }
    for (int g = 0; g < G; g++) {
        float *s = scores + (size_t)g * len, m = -FLT_MAX, sum = 0.f;
        mask_head(s, skip);
        for (int64_t t = 0; t < len; t++) m = s[t] > m ? s[t] : m;
        for (int64_t t = 0; t < len; t++) { s[t] = expf(s[t] - m); sum += s[t]; }
        float inv = 1.f / sum;
        for (int64_t t = 0; t < len; t++) s[t] *= inv;
    }
    memset(acc, 0, sizeof(float) * G * D);
    for (int64_t b = 0; b < nblk; b++) {
        int n = (int)((b + 1) * bs <= len ? bs : len - b * bs);
        const char *vb = generic_rows(vc + ((size_t)table[b] * bs * KVH + kh) * hrow, row, n, D, fmt, buf, &stride, &f);
        for (int t = 0; t < n; t++) {
            const char *vr = vb + t * stride;
            for (int g = 0; g < G; g++) {
                const float p = scores[(size_t)g * len + b * bs + t];
                if (f == KV_F32) {
                    axpy_f32(acc + (size_t)g * D, p, (const float *)vr, D);
                    continue;
                }
                for (int i = 0; i < D; i++) acc[(size_t)g * D + i] += p * kv_at(vr, i, f);
            }
        }
    }
    memcpy(out, acc, sizeof(float) * G * D);
}

/* Work item w = (sequence w / KVH, KV head w % KVH): its G query heads' outputs. Not static:
 * step.c's one-region decode step runs the items itself. Returns 0, or -1 without scratch memory. */
int paged_attention_item(const float *q, const void *kc, const void *vc, const int64_t *tables, const int64_t *lens,
                         const int64_t *skips, float *out, int w, int H, int KVH, int D, int bs, int max_blocks,
                         float scale, int kv_fmt) {
    const int G = H / KVH, b = w / KVH, kh = w % KVH;
    /* per item: a few KB, far cheaper than the attention it serves */
    float *scratch = malloc(sizeof(float) * ((size_t)G * lens[b] + (size_t)G * D + (size_t)bs * D));
    if (!scratch) return -1;
    const float *qi = q + ((size_t)b * H + (size_t)kh * G) * D;
    float *oi = out + ((size_t)b * H + (size_t)kh * G) * D;
    const int64_t *table = tables + (size_t)b * max_blocks, skip = skips ? skips[b] : 0;
#ifdef __AVX2__
    float *acc = scratch + (size_t)G * lens[b], *buf = acc + (size_t)G * D;
    if (D == 64)
        attend_d64(qi, kc, vc, table, lens[b], skip, oi, G, KVH, kh, kh + 1, bs, scale, scratch, acc, buf, kv_fmt, 0);
    else
#endif
        attend_generic(qi, kc, vc, table, lens[b], skip, oi, G, KVH, kh, D, bs, scale, scratch,
                       scratch + (size_t)G * lens[b], scratch + (size_t)G * lens[b] + (size_t)G * D, kv_fmt);
    free(scratch);
    return 0;
}

/* All KV heads of sequence b at once (its H query heads' outputs): with D = 64 through
 * attend_d64 (every cache format), else head by head (paged_attention_item). Not static: step.c
 * runs a row an item where there are rows enough for every thread. Returns 0, or -1 without
 * scratch memory. */
int paged_attention_row(const float *q, const void *kc, const void *vc, const int64_t *tables, const int64_t *lens,
                        const int64_t *skips, float *out, int b, int H, int KVH, int D, int bs, int max_blocks,
                        float scale, int kv_fmt) {
#ifdef __AVX2__
    if (D == 64) {
        float *scratch = malloc(sizeof(float) * ((size_t)H * lens[b] + (size_t)H * D + (size_t)bs * D));
        if (!scratch) return -1;
        const float *qi = q + (size_t)b * H * D;
        float *oi = out + (size_t)b * H * D, *acc = scratch + (size_t)H * lens[b], *buf = acc + (size_t)H * D;
        const int64_t *table = tables + (size_t)b * max_blocks, skip = skips ? skips[b] : 0;
        attend_d64(qi, kc, vc, table, lens[b], skip, oi, H / KVH, KVH, 0, KVH, bs, scale, scratch, acc, buf, kv_fmt, 1);
        free(scratch);
        return 0;
    }
#endif
    for (int kh = 0; kh < KVH; kh++)
        if (paged_attention_item(q, kc, vc, tables, lens, skips, out, b * KVH + kh, H, KVH, D, bs, max_blocks, scale,
                                 kv_fmt))
            return -1;
    return 0;
}
