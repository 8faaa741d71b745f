/* The pieces of paged attention that the one-row kernel (attention.c) and the multi-row kernel
 * (attention_rows.c) share: masking, softmax numerators, and for D = 64 over a float cache the
 * scores of one block's keys and one block's weighted values. Both kernels run these same
 * functions per (row, head, block), only in another loop order, so a row's result is the same
 * bits whichever kernel computed it. */
#ifndef PDSERVE_ATTEND_H
#define PDSERVE_ATTEND_H
#include <float.h>
#include <stdint.h>
#include "kvformat.h"
#ifdef __AVX2__
#include "vecmath.h" /* exp8: softmax after subtracting the max (scalar expf was a third of the kernel at 32 x 192 tokens) */
#endif

/* The first `skip` keys of a row's table are not its to see (they precede its attention
 * window, in the window's first block): their scores become -FLT_MAX, exp() 0. */
static inline void mask_head(float *s, int64_t skip) {
    for (int64_t t = 0; t < skip; t++) s[t] = -FLT_MAX;
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

/* One head's query (64 floats) times the softmax scale, in 8 registers. */
static inline __attribute__((always_inline)) void scaled_q_d64(const float *q, float scale, __m256 *qv) {
    for (int c = 0; c < 8; c++) qv[c] = _mm256_mul_ps(_mm256_loadu_ps(q + 8 * c), _mm256_set1_ps(scale));
}

/* s[t] = qv . k_t for the block's first n keys (token stride `row` bytes; fmt KV_F32 or
 * KV_BF16): 8 keys at a time through reduce8, the rest one by one. */
static inline __attribute__((always_inline)) void block_scores_d64(const __m256 *qv, const char *kb, size_t row,
                                                                  int n, float *s, const int fmt) {
    const size_t esz = fmt == KV_F32 ? 4 : 2;
    int t = 0;
    for (; t + 8 <= n; t += 8) {
        __m256 a[8];
        for (int u = 0; u < 8; u++) a[u] = _mm256_setzero_ps();
        for (int c = 0; c < 8; c++)
            for (int u = 0; u < 8; u++) a[u] = _mm256_fmadd_ps(qv[c], kv8(kb + (t + u) * row + 8 * c * esz, fmt), a[u]);
        _mm256_storeu_ps(s + t, reduce8(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]));
    }
    for (; t < n; t++) {
        __m256 a = _mm256_setzero_ps();
        for (int c = 0; c < 8; c++) a = _mm256_fmadd_ps(qv[c], kv8(kb + t * row + 8 * c * esz, fmt), a);
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        h = _mm_hadd_ps(h, h);
        s[t] = _mm_cvtss_f32(_mm_hadd_ps(h, h));
    }
}

/* acc += sum over the block's first n tokens of p[t] * v_t, in token order. */
static inline __attribute__((always_inline)) void block_values_d64(__m256 *acc, const float *p, const char *vb,
                                                                  size_t row, int n, const int fmt) {
    const size_t esz = fmt == KV_F32 ? 4 : 2;
    for (int t = 0; t < n; t++) {
        const __m256 pv = _mm256_set1_ps(p[t]);
        for (int c = 0; c < 8; c++) acc[c] = _mm256_fmadd_ps(pv, kv8(vb + t * row + 8 * c * esz, fmt), acc[c]);
    }
}

/* out (64 floats) = acc / sum. */
static inline void head_out_d64(const __m256 *acc, float sum, float *out) {
    const __m256 inv = _mm256_set1_ps(1.f / sum);
    for (int c = 0; c < 8; c++) _mm256_storeu_ps(out + 8 * c, _mm256_mul_ps(acc[c], inv));
}
#endif /* __AVX2__ */
#endif
