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
 *                                         (engine/kv_format.py), the scale applied to the
 *                                         row's dot product and to its softmax weight
 *   tables (B, max_blocks) int64          block ids of each sequence
 *   lens   (B,) int64                     tokens in context, including the new one
 *   out    (B, H, D)
 * GQA: query head h reads KV head h / (H / KVH). Work items are (sequence, KV head) pairs,
 * so the G = H / KVH query heads sharing a KV head read each K/V row from memory once (the
 * later heads of the group find it in L2).
 * Two passes per item: scores for every cached token (K read once), then softmax, then the
 * weighted sum of V (V read once). */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include "vecmath.h" /* exp8: softmax after subtracting the max (scalar expf was a third of the kernel at 32 x 192 tokens) */
#endif

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

enum { KV_F32 = 0, KV_BF16 = 1, KV_INT8 = 2, KV_FP8 = 3 };

/* Bytes of one (token, KV head) row. */
static inline size_t head_row_bytes(int fmt, int D) {
    return fmt == KV_F32 ? (size_t)D * 4 : fmt == KV_BF16 ? (size_t)D * 2 : (size_t)D + 4;
}

/* The row's scale (1 for the float formats). */
static inline float row_scale(const char *row, int fmt, int D) {
    if (fmt < KV_INT8) return 1.f;
    float s;
    memcpy(&s, row + D, 4);
    return s;
}

/* fp8 e4m3fn code -> float: normal numbers re-biased (exponent bias 7 -> 127), subnormals
 * (exponent 0) m * 2^-9. The formats have no infinities; 0x7f/0xff (NaN) are never stored. */
static inline float fp8_to_f32(uint8_t c) {
    uint32_t em = c & 0x7f, u;
    float f;
    if (em < 8) f = (float)em * (1.f / 512.f);
    else {
        u = (em << 20) + (120u << 23);
        memcpy(&f, &u, 4);
    }
    return c & 0x80 ? -f : f;
}

/* Element i of a K/V row, unscaled. */
static inline float kv_at(const void *row, int64_t i, int fmt) {
    if (fmt == KV_F32) return ((const float *)row)[i];
    if (fmt == KV_INT8) return (float)((const int8_t *)row)[i];
    if (fmt == KV_FP8) return fp8_to_f32(((const uint8_t *)row)[i]);
    uint32_t u = (uint32_t)((const uint16_t *)row)[i] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float dot_kv(const float *q, const char *k, int n, int fmt) {
    if (fmt == KV_F32) return dot_f32(q, (const float *)k, n);
    float s = 0.f;
    for (int i = 0; i < n; i++) s += q[i] * kv_at(k, i, fmt);
    return s * row_scale(k, fmt, n);
}

#ifdef __AVX2__
/* 8 consecutive K/V elements as fp32 (8-bit codes unscaled). */
static inline __m256 kv8(const void *p, int fmt) {
    if (fmt == KV_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
    if (fmt == KV_INT8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    if (fmt == KV_FP8) { /* as fp8_to_f32, 8 lanes */
        __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
        __m256i em = _mm256_and_si256(x, _mm256_set1_epi32(0x7f));
        __m256 normal = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(em, 20), _mm256_set1_epi32(120 << 23)));
        __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(em), _mm256_set1_ps(1.f / 512.f));
        __m256 is_sub = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), em));
        __m256 sign = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x80)), 24));
        return _mm256_or_ps(_mm256_blendv_ps(normal, sub, is_sub), sign);
    }
    return _mm256_loadu_ps((const float *)p);
}

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
                                                            const int64_t *table, int64_t len, float *out, int G,
                                                            int KVH, int kh, int bs, float scale, float *scores,
                                                            const int fmt) {
    enum { D = 64, C = D / 8 };
    const size_t hrow = head_row_bytes(fmt, D), row = (size_t)KVH * hrow; /* bytes between tokens of a block */
    const size_t esz = fmt == KV_F32 ? 4 : fmt == KV_BF16 ? 2 : 1;
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
                if (fmt >= KV_INT8) {
                    float sc[8];
                    for (int u = 0; u < 8; u++) sc[u] = row_scale(kb + (t + u) * row, fmt, D);
                    r = _mm256_mul_ps(r, _mm256_loadu_ps(sc));
                }
                _mm256_storeu_ps(s + b * bs + t, r);
            }
            for (; t < n; t++) {
                __m256 a = _mm256_setzero_ps();
                for (int c = 0; c < C; c++) a = _mm256_fmadd_ps(qv[c], kv8(kb + t * row + 8 * c * esz, fmt), a);
                __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
                h = _mm_hadd_ps(h, h);
                s[b * bs + t] = _mm_cvtss_f32(_mm_hadd_ps(h, h)) * row_scale(kb + t * row, fmt, D);
            }
        }
        const float sum = softmax_numerators(s, len);
        __m256 acc[C];
        for (int c = 0; c < C; c++) acc[c] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nblk; b++) {
            const char *vb = vc + ((size_t)table[b] * bs * KVH + kh) * hrow;
            int n = (int)((b + 1) * bs <= len ? bs : len - b * bs);
            for (int t = 0; t < n; t++) {
                __m256 p = _mm256_set1_ps(s[b * bs + t] * row_scale(vb + t * row, fmt, D));
                for (int c = 0; c < C; c++) acc[c] = _mm256_fmadd_ps(p, kv8(vb + t * row + 8 * c * esz, fmt), acc[c]);
            }
        }
        __m256 inv = _mm256_set1_ps(1.f / sum);
        for (int c = 0; c < C; c++) _mm256_storeu_ps(out + g * D + 8 * c, _mm256_mul_ps(acc[c], inv));
    }
}
#endif

static void attend_generic(const float *q, const char *kc, const char *vc, const int64_t *table, int64_t len,
                           float *out, int G, int KVH, int kh, int D, int bs, float scale, float *scores, float *acc,
                           int fmt) {
    const size_t hrow = head_row_bytes(fmt, D), row = (size_t)KVH * hrow; /* bytes between tokens of a block */
    int64_t nblk = (len + bs - 1) / bs;
    for (int64_t b = 0; b < nblk; b++) {
        const char *kb = kc + ((size_t)table[b] * bs * KVH + kh) * hrow;
        int n = (int)((b + 1) * bs <= len ? bs : len - b * bs);
        for (int t = 0; t < n; t++)
            for (int g = 0; g < G; g++)
                scores[(size_t)g * len + b * bs + t] = dot_kv(q + (size_t)g * D, kb + t * row, D, fmt) * scale;
    }
    for (int g = 0; g < G; g++) {
        float *s = scores + (size_t)g * len, m = -FLT_MAX, sum = 0.f;
        for (int64_t t = 0; t < len; t++) m = s[t] > m ? s[t] : m;
        for (int64_t t = 0; t < len; t++) { s[t] = expf(s[t] - m); sum += s[t]; }
        float inv = 1.f / sum;
        for (int64_t t = 0; t < len; t++) s[t] *= inv;
    }
    memset(acc, 0, sizeof(float) * G * D);
    for (int64_t b = 0; b < nblk; b++) {
        const char *vb = vc + ((size_t)table[b] * bs * KVH + kh) * hrow;
        int n = (int)((b + 1) * bs <= len ? bs : len - b * bs);
        for (int t = 0; t < n; t++) {
            const char *vr = vb + t * row;
            const float vs = row_scale(vr, fmt, D);
            for (int g = 0; g < G; g++) {
                const float p = scores[(size_t)g * len + b * bs + t] * vs;
                if (fmt == KV_F32) {
                    axpy_f32(acc + (size_t)g * D, p, (const float *)vr, D);
                    continue;
                }
                for (int i = 0; i < D; i++) acc[(size_t)g * D + i] += p * kv_at(vr, i, fmt);
            }
        }
    }
    memcpy(out, acc, sizeof(float) * G * D);
}

/* Returns 0, or -1 when scratch memory could not be allocated. kv_fmt: the caches' format (KV_*). */
int paged_decode_attention_f32(const float *q, const void *kc, const void *vc, const int64_t *tables,
                               const int64_t *lens, float *out, int B, int H, int KVH, int D, int bs,
                               int max_blocks, float scale, int nthreads, int kv_fmt) {
    const int G = H / KVH;
    int failed = 0;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1) reduction(| : failed)
    for (int w = 0; w < B * KVH; w++) {
        int b = w / KVH, kh = w % KVH;
        /* per item: a few KB, far cheaper than the attention it serves */
        float *scratch = malloc(sizeof(float) * ((size_t)G * lens[b] + (size_t)G * D));
        if (!scratch) {
            failed = 1;
            continue;
        }
        const float *qi = q + ((size_t)b * H + (size_t)kh * G) * D;
        float *oi = out + ((size_t)b * H + (size_t)kh * G) * D;
        const int64_t *table = tables + (size_t)b * max_blocks;
#ifdef __AVX2__
        if (D == 64 && kv_fmt == KV_F32)
            attend_d64(qi, kc, vc, table, lens[b], oi, G, KVH, kh, bs, scale, scratch, KV_F32);
        else if (D == 64 && kv_fmt == KV_BF16)
            attend_d64(qi, kc, vc, table, lens[b], oi, G, KVH, kh, bs, scale, scratch, KV_BF16);
        else if (D == 64 && kv_fmt == KV_INT8)
            attend_d64(qi, kc, vc, table, lens[b], oi, G, KVH, kh, bs, scale, scratch, KV_INT8);
        else if (D == 64 && kv_fmt == KV_FP8)
            attend_d64(qi, kc, vc, table, lens[b], oi, G, KVH, kh, bs, scale, scratch, KV_FP8);
        else
#endif
            attend_generic(qi, kc, vc, table, lens[b], oi, G, KVH, kh, D, bs, scale, scratch,
                           scratch + (size_t)G * lens[b], kv_fmt);
        free(scratch);
    }
    return failed ? -1 : 0;
}

/* fp32 -> fp8 e4m3fn, rounded to nearest even (as torch converts), |v| saturated at 448. */
static inline uint8_t f32_to_fp8(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80);
    const float a = fabsf(v);
    if (!(a < 448.f)) return sign | 0x7e;
    if (a < 0.015625f) return sign | (uint8_t)nearbyintf(a * 512.f); /* subnormal: m * 2^-9 (8: the least normal) */
    memcpy(&u, &a, 4);
    u = (u + 0x7ffff + ((u >> 20) & 1)) >> 20; /* exponent and 3 mantissa bits, the rest rounded off */
    const uint32_t code = u - (120u << 3);      /* exponent bias 127 -> 7 */
    return sign | (uint8_t)(code > 0x7e ? 0x7e : code);
}

/* Store T new K (or V) rows (T, KVH, D) fp32 into an 8-bit cache (KV_INT8 / KV_FP8) at flat
 * slots `slots` (T,): per (token, head) row the codes of x / scale, scale = absmax / qmax (1
 * for an all-zero row), then the scale -- what engine/kv_format.encode writes, bit for bit. */
void kv_store_8bit(const float *x, void *cache, const int64_t *slots, int T, int KVH, int D, int fmt) {
    const float qmax = fmt == KV_INT8 ? 127.f : 448.f;
    const size_t hrow = head_row_bytes(fmt, D);
    for (int r = 0; r < T * KVH; r++) {
        const float *src = x + (size_t)r * D;
        uint8_t *dst = (uint8_t *)cache + ((size_t)slots[r / KVH] * KVH + r % KVH) * hrow;
        float amax = 0.f;
        for (int i = 0; i < D; i++) amax = fabsf(src[i]) > amax ? fabsf(src[i]) : amax;
        const float scale = amax > 0.f ? amax / qmax : 1.f;
        if (fmt == KV_INT8)
            for (int i = 0; i < D; i++) {
                float c = nearbyintf(src[i] / scale);
                ((int8_t *)dst)[i] = (int8_t)(c > 127.f ? 127.f : c < -127.f ? -127.f : c);
            }
        else
            for (int i = 0; i < D; i++) dst[i] = f32_to_fp8(src[i] / scale);
        memcpy(dst + D, &scale, 4);
    }
}
