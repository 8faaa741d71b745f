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
 * GQA: query head h reads KV head h / (H / KVH). Work items are (sequence, KV head) pairs,
 * so the G = H / KVH query heads sharing a KV head read each K/V row from memory once (the
 * later heads of the group find it in L2).
 * Two passes per item: scores for every cached token (K read once), then softmax, then the
 * weighted sum of V (V read once). An 8-bit cache's rows are decoded block by block into an
 * fp32 buffer shared by the group's heads, then attended as fp32: the result is bitwise the
 * fp32 kernel's over the decoded cache. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "kvformat.h"
#ifdef __AVX2__
#include "vecmath.h" /* exp8: softmax after subtracting the max (scalar expf was a third of the kernel at 32 x 192 tokens) */
#endif

/* The first `skip` keys of a row's table are not its to see (they precede its attention
 * window, in the window's first block): their scores become -FLT_MAX, exp() 0. */
static inline void mask_head(float *s, int64_t skip) {
    for (int64_t t = 0; t < skip; t++) s[t] = -FLT_MAX;
}


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
/* 8 dot products at once: acc[t] holds token t's partial sums; one hadd tree reduces them
 * into a vector of 8 scores (a horizontal sum per token would cost as much as its FMAs). */
static inline __m256 reduce8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6,
                             __m256 a7) {
    __m256 t01 = _mm256_hadd_ps(a0, a1), t23 = _mm256_hadd_ps(a2, a3);
    __m256 t45 = _mm256_hadd_ps(a4, a5), t67 = _mm256_hadd_ps(a6, a7);
    __m256 lo = _mm256_hadd_ps(t01, t23), hi = _mm256_hadd_ps(t45, t67);
    return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}

/* s[0..len) <- exp(s - max s); returns the sum. */
static inline float softmax_numerators(float *s, int64_t len) {
    __m256 mv = _mm256_set1_ps(-FLT_MAX);
    int64_t t = 0;
    for (; t + 8 <= len; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + t));
    float m = -FLT_MAX, tail[8];
    _mm256_storeu_ps(tail, mv);
    for (int i = 0; i < 8; i++) m = tail[i] > m ? tail[i] : m;
    for (; t < len; t++) m = s[t] > m ? s[t] : m;
    __m256 sv = _mm256_setzero_ps(), m8 = _mm256_set1_ps(m);
    for (t = 0; t + 8 <= len; t += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), m8));
        _mm256_storeu_ps(s + t, e);
        sv = _mm256_add_ps(sv, e);
    }
    if (t < len) { /* the last < 8 scores, through a padded copy */
        int n = (int)(len - t);
        for (int i = 0; i < 8; i++) tail[i] = i < n ? s[t + i] : -FLT_MAX;
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(tail), m8));
        _mm256_storeu_ps(tail, e);
        for (int i = 0; i < n; i++) s[t + i] = tail[i];
        sv = _mm256_add_ps(sv, e); /* the padding lanes are exp(-87 and below) = 0 */
    }
    _mm256_storeu_ps(tail, sv);
    float sum = 0.f;
    for (int i = 0; i < 8; i++) sum += tail[i];
    return sum;
}

/* D = 64 (SmolLM2, Llama-style small models): q and the output accumulator of one head fit
 * in 8 registers each; `inline` with a constant D and fmt lets the compiler unroll the chunk
 * loops and drop the other formats' branches. */
static inline __attribute__((always_inline)) void attend_d64(const float *q, const char *kc, const char *vc,
                                                            const int64_t *table, int64_t len, int64_t skip,
                                                            float *out, int G, int KVH, int kh, int bs, float scale,
                                                            float *scores, const int fmt) {
    enum { D = 64, C = D / 8 };
    const size_t hrow = head_row_bytes(fmt, D), row = (size_t)KVH * hrow; /* bytes between tokens of a block */
    const size_t esz = fmt == KV_F32 ? 4 : fmt == KV_BF16 ? 2 : 1;
    const float unit = kv8_unit(fmt);
    const int64_t nblk = (len + bs - 1) / bs;
    for (int g = 0; g < G; g++) {
        __m256 qv[C];
        for (int c = 0; c < C; c++) qv[c] = _mm256_mul_ps(_mm256_loadu_ps(q + g * D + 8 * c), _mm256_set1_ps(scale));
        float *s = scores + (size_t)g * len;
        for (int64_t b = 0; b < nblk; b++) {
            const char *kb = kc + ((size_t)table[b] * bs * KVH + kh) * hrow;
            int n = (int)((b + 1) * bs <= len ? bs : len - b * bs), t = 0;
            for (; t + 8 <= n; t += 8) {
                __m256 a[8];
                for (int u = 0; u < 8; u++) a[u] = _mm256_setzero_ps();
                for (int c = 0; c < C; c++)
                    for (int u = 0; u < 8; u++)
                        a[u] = _mm256_fmadd_ps(qv[c], kv8(kb + (t + u) * row + 8 * c * esz, fmt), a[u]);
                __m256 r = reduce8(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]);
                if (fmt >= KV_INT8) { /* (set, not stores then a load: that stalls store forwarding) */
                    const char *k0 = kb + t * row;
                    r = _mm256_mul_ps(r, _mm256_mul_ps(_mm256_set1_ps(unit), _mm256_setr_ps(
                        row_scale(k0, fmt, D), row_scale(k0 + row, fmt, D), row_scale(k0 + 2 * row, fmt, D),
                        row_scale(k0 + 3 * row, fmt, D), row_scale(k0 + 4 * row, fmt, D), row_scale(k0 + 5 * row, fmt, D),
                        row_scale(k0 + 6 * row, fmt, D), row_scale(k0 + 7 * row, fmt, D))));
                }
                _mm256_storeu_ps(s + b * bs + t, r);
            }
            for (; t < n; t++) {
                __m256 a = _mm256_setzero_ps();
                for (int c = 0; c < C; c++) a = _mm256_fmadd_ps(qv[c], kv8(kb + t * row + 8 * c * esz, fmt), a);
                __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
                h = _mm_hadd_ps(h, h);
                s[b * bs + t] = _mm_cvtss_f32(_mm_hadd_ps(h, h)) * (row_scale(kb + t * row, fmt, D) * unit);
            }
        }
        mask_head(s, skip);
        const float sum = softmax_numerators(s, len);
        __m256 acc[C];
        for (int c = 0; c < C; c++) acc[c] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nblk; b++) {
            const char *vb = vc + ((size_t)table[b] * bs * KVH + kh) * hrow;
            int n = (int)((b + 1) * bs <= len ? bs : len - b * bs);
            for (int t = 0; t < n; t++) {
                __m256 p = _mm256_set1_ps(s[b * bs + t] * (row_scale(vb + t * row, fmt, D) * unit));
                for (int c = 0; c < C; c++) acc[c] = _mm256_fmadd_ps(p, kv8(vb + t * row + 8 * c * esz, fmt), acc[c]);
            }
        }
        __m256 inv = _mm256_set1_ps(1.f / sum);
        for (int c = 0; c < C; c++) _mm256_storeu_ps(out + g * D + 8 * c, _mm256_mul_ps(acc[c], inv));
    }
}
#endif

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

/* D = 64 over an 8-bit cache: each block is decoded once for the G heads (not once per head),
 * then scores, softmax and the weighted sum of V run as in attend_d64 on fp32 rows. buf: bs * 64. */
static inline __attribute__((always_inline)) void attend_d64_8bit(const float *q, const char *kc, const char *vc,
                                                                 const int64_t *table, int64_t len, int64_t skip,
                                                                 float *out, int G, int KVH, int kh, int bs,
                                                                 float scale, float *scores, float *buf,
                                                                 const int fmt) {
    enum { D = 64, C = D / 8 };
    const size_t hrow = head_row_bytes(fmt, D), row = (size_t)KVH * hrow;
    const int64_t nblk = (len + bs - 1) / bs;
    for (int64_t b = 0; b < nblk; b++) {
        int n = (int)((b + 1) * bs <= len ? bs : len - b * bs);
        decode_rows_d64(kc + ((size_t)table[b] * bs * KVH + kh) * hrow, row, n, buf, fmt);
        for (int g = 0; g < G; g++) {
            __m256 qv[C];
            for (int c = 0; c < C; c++) qv[c] = _mm256_mul_ps(_mm256_loadu_ps(q + g * D + 8 * c), _mm256_set1_ps(scale));
            float *s = scores + (size_t)g * len + b * bs;
            int t = 0;
            for (; t + 8 <= n; t += 8) {
                __m256 a[8];
                for (int u = 0; u < 8; u++) a[u] = _mm256_setzero_ps();
                for (int c = 0; c < C; c++)
                    for (int u = 0; u < 8; u++)
                        a[u] = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(buf + (t + u) * D + 8 * c), a[u]);
                _mm256_storeu_ps(s + t, reduce8(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]));
            }
            for (; t < n; t++) {
                __m256 a = _mm256_setzero_ps();
                for (int c = 0; c < C; c++) a = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(buf + t * D + 8 * c), a);
                __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
                h = _mm_hadd_ps(h, h);
                s[t] = _mm_cvtss_f32(_mm_hadd_ps(h, h));
            }
        }
    }
    float inv[G];
    for (int g = 0; g < G; g++) {
        mask_head(scores + (size_t)g * len, skip);
        inv[g] = 1.f / softmax_numerators(scores + (size_t)g * len, len);
    }
    memset(out, 0, sizeof(float) * G * D);
    for (int64_t b = 0; b < nblk; b++) {
        int n = (int)((b + 1) * bs <= len ? bs : len - b * bs);
        decode_rows_d64(vc + ((size_t)table[b] * bs * KVH + kh) * hrow, row, n, buf, fmt);
        for (int g = 0; g < G; g++) {
            const float *s = scores + (size_t)g * len + b * bs;
            __m256 acc[C];
            for (int c = 0; c < C; c++) acc[c] = _mm256_loadu_ps(out + g * D + 8 * c);
            for (int t = 0; t < n; t++) {
                __m256 p = _mm256_set1_ps(s[t]);
                for (int c = 0; c < C; c++) acc[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(buf + t * D + 8 * c), acc[c]);
            }
            for (int c = 0; c < C; c++) _mm256_storeu_ps(out + g * D + 8 * c, acc[c]);
        }
    }
    for (int g = 0; g < G; g++)
        for (int c = 0; c < C; c++)
            _mm256_storeu_ps(out + g * D + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(out + g * D + 8 * c), _mm256_set1_ps(inv[g])));
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
    if (D == 64 && kv_fmt == KV_F32)
        attend_d64(qi, kc, vc, table, lens[b], skip, oi, G, KVH, kh, bs, scale, scratch, KV_F32);
    else if (D == 64 && kv_fmt == KV_BF16)
        attend_d64(qi, kc, vc, table, lens[b], skip, oi, G, KVH, kh, bs, scale, scratch, KV_BF16);
    else if (D == 64 && kv_fmt == KV_INT8)
        attend_d64_8bit(qi, kc, vc, table, lens[b], skip, oi, G, KVH, kh, bs, scale, scratch, scratch + (size_t)G * lens[b],
                        KV_INT8);
    else if (D == 64 && kv_fmt == KV_FP8)
        attend_d64_8bit(qi, kc, vc, table, lens[b], skip, oi, G, KVH, kh, bs, scale, scratch, scratch + (size_t)G * lens[b],
                        KV_FP8);
    else
#endif
        attend_generic(qi, kc, vc, table, lens[b], skip, oi, G, KVH, kh, D, bs, scale, scratch,
                       scratch + (size_t)G * lens[b], scratch + (size_t)G * lens[b] + (size_t)G * D, kv_fmt);
    free(scratch);
    return 0;
}

/* Returns 0, or -1 when scratch memory could not be allocated. kv_fmt: the caches' format (KV_*). */
int paged_decode_attention_f32(const float *q, const void *kc, const void *vc, const int64_t *tables,
                               const int64_t *lens, const int64_t *skips, float *out, int B, int H, int KVH, int D,
                               int bs, int max_blocks, float scale, int nthreads, int kv_fmt) {
    int failed = 0;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1) reduction(| : failed)
    for (int w = 0; w < B * KVH; w++)
        failed |= paged_attention_item(q, kc, vc, tables, lens, skips, out, w, H, KVH, D, bs, max_blocks, scale,
                                       kv_fmt) != 0;
    return failed ? -1 : 0;
}
