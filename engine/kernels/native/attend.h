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

/* The D = 64 pieces below run on `avec`, AV_C vectors a head: 512-bit where the build targets
 * AVX-512 (4 a head: half the multiply-adds of 8 x 256-bit), else 256-bit. The sums' order
 * follows the vector width, so results differ in the last bits between builds; within a build
 * every kernel that attends (one row, runs of rows, the one-call step) runs these functions. */
#ifdef __AVX512F__
typedef __m512 avec;
#define AV_C 4
#define av_load _mm512_loadu_ps
#define av_store _mm512_storeu_ps
#define av_set1 _mm512_set1_ps
#define av_mul _mm512_mul_ps
#define av_fmadd _mm512_fmadd_ps
#define av_zero _mm512_setzero_ps
#define av_add _mm512_add_ps
/* 16 consecutive float-format K/V elements (fp32, bf16) as fp32. */
static inline avec kvv(const void *p, int fmt) {
    if (fmt == KV_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
    return _mm512_loadu_ps((const float *)p);
}
/* A vector's two 256-bit halves added: its 16 partial sums as 8. */
static inline __m256 av_fold(avec a) {
    return _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
}
#else
typedef __m256 avec;
#define AV_C 8
#define av_load _mm256_loadu_ps
#define av_store _mm256_storeu_ps
#define av_set1 _mm256_set1_ps
#define av_mul _mm256_mul_ps
#define av_fmadd _mm256_fmadd_ps
#define av_zero _mm256_setzero_ps
#define av_add _mm256_add_ps
static inline avec kvv(const void *p, int fmt) { return kv8(p, fmt); }
static inline __m256 av_fold(avec a) { return a; }
#endif
#define AV_LANES (64 / AV_C)

/* A bf16 cache's blocks in AVX-512 BF16 vectors (`vdpbf16ps`, 32 bf16 products an instruction
 * summed in fp32) where the build targets them (PDSERVE_BF16_VECTORS: cpu.py `bf16_vectors`),
 * read in place: no widening to fp32 first, which cost as much as the multiply-adds (30 layers of
 * 32 rows x 256 keys on a 2-core Zen 4: 33.2 -> 24.8 ms on one core, where it now reads as many
 * bytes a second as the fp32 kernel; 15.3-19.6 -> 14.0-14.7 ms on two, in turn with the widening).
 * The query is three bf16 terms (to 2^-24 of it, as fp32) and the numerators two (their value and
 * the rest, to 2^-16), all multiplied in, so K and V meet ~fp32 operands: the results are near the
 * widened kernel's, not its bits. Every kernel that attends a bf16 cache here
 * runs these same functions, so a row's result is still the same bits from any of them. */
#if defined(PDSERVE_BF16_VECTORS) && defined(__AVX512BF16__) && defined(__AVX512BW__) && AV_C == 4
#define ATTEND_BF16 1
#else
#define ATTEND_BF16 0
#endif
/* The format the block functions read after as_read: a bf16 cache in place, else fp32 rows. */
#define READ_FMT(fmt) (ATTEND_BF16 && (fmt) == KV_BF16 ? KV_BF16 : KV_F32)
/* Vectors of one head's query as the block functions read it (query_d64): fp32 in AV_C, or for
 * bf16 blocks three bf16 terms of 64 values in two vectors each. */
#if ATTEND_BF16
#define QV_N 6
#else
#define QV_N AV_C
#endif

#if ATTEND_BF16
/* 16 bf16 (the low or high half of a vector) as fp32. */
static inline __m512 bf16_widen16(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* One head's scaled query (64 floats) as three bf16 terms, each two vectors (dims 0-31, 32-63):
 * qv[0..1] its values rounded, qv[2..3] what they left rounded, qv[4..5] what those left: their
 * sum is within 2^-24 of the query, as fp32 keeps it. Two terms (2^-16) cost 0.6% perplexity on
 * the decode path over 6,267 tokens: SmolLM2's scores reach the hundreds, and a score's error is
 * the query's times |k| summed. */
static inline void split_q_d64(const float *q, float scale, avec *qv) {
    const __m512 s = _mm512_set1_ps(scale);
    for (int c = 0; c < 2; c++) {
        __m512 a = _mm512_mul_ps(_mm512_loadu_ps(q + 32 * c), s), b = _mm512_mul_ps(_mm512_loadu_ps(q + 32 * c + 16), s);
        for (int term = 0; term < 3; term++) {
            const __m512i h = (__m512i)_mm512_cvtne2ps_pbh(b, a);
            a = _mm512_sub_ps(a, bf16_widen16(_mm512_castsi512_si256(h)));
            b = _mm512_sub_ps(b, bf16_widen16(_mm512_extracti64x4_epi64(h, 1)));
            qv[2 * term + c] = _mm512_castsi512_ps(h);
        }
    }
}

/* a + the split query . one bf16 key row (64 dims), per half the smallest term first. */
static inline __attribute__((always_inline)) __m512 bf16_dot_d64(const avec *qv, const char *k, __m512 a) {
    for (int c = 0; c < 2; c++) {
        const __m512bh kv = (__m512bh)_mm512_loadu_si512((const void *)(k + 64 * c));
        for (int term = 2; term >= 0; term--)
            a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_castps_si512(qv[2 * term + c]), kv);
    }
    return a;
}

/* acc (the pair layout: vector 2c + j holds, in its 128-bit lane L, dims 32c + 8L + 4j + 0..3)
 * += sum over the block's first n tokens of p[t] * v_t. Tokens go in pairs, each pair's two V
 * rows interleaved (unpack) against the pair's numerators (value halves into acc, rests into
 * their own sums, added at the block's end: 8 chains at once); an odd last token pairs with zeros. */
static inline __attribute__((always_inline)) void bf16_block_values_d64(avec *acc, const float *p, const char *vb,
                                                                       size_t row, int n) {
    avec rest[4];
    for (int i = 0; i < 4; i++) rest[i] = _mm512_setzero_ps();
    for (int t0 = 0; t0 < n; t0 += 16) {
        const int m = n - t0 < 16 ? n - t0 : 16;
        const __m512 x = _mm512_maskz_loadu_ps((__mmask16)((1u << m) - 1), p + t0);
        const __m256i h = (__m256i)_mm512_cvtneps_pbh(x);
        const __m256i l = (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(x, bf16_widen16(h)));
        uint32_t hp[8], lp[8];
        _mm256_storeu_si256((__m256i *)hp, h);
        _mm256_storeu_si256((__m256i *)lp, l);
        for (int j = 0; 2 * j < m; j++) {
            const char *v0 = vb + (size_t)(t0 + 2 * j) * row;
            const int both = 2 * j + 1 < m;
            const __m512bh ph = (__m512bh)_mm512_set1_epi32((int)hp[j]), pl = (__m512bh)_mm512_set1_epi32((int)lp[j]);
            for (int c = 0; c < 2; c++) {
                const __m512i x0 = _mm512_loadu_si512((const void *)(v0 + 64 * c));
                const __m512i x1 = both ? _mm512_loadu_si512((const void *)(v0 + row + 64 * c)) : _mm512_setzero_si512();
                const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(x0, x1), hi = (__m512bh)_mm512_unpackhi_epi16(x0, x1);
                acc[2 * c] = _mm512_dpbf16_ps(acc[2 * c], ph, lo);
                rest[2 * c] = _mm512_dpbf16_ps(rest[2 * c], pl, lo);
                acc[2 * c + 1] = _mm512_dpbf16_ps(acc[2 * c + 1], ph, hi);
                rest[2 * c + 1] = _mm512_dpbf16_ps(rest[2 * c + 1], pl, hi);
            }
        }
    }
    for (int i = 0; i < 4; i++) acc[i] = _mm512_add_ps(acc[i], rest[i]);
}
#endif

/* One head's query (64 floats) times the softmax scale, in AV_C registers. */
static inline __attribute__((always_inline)) void scaled_q_d64(const float *q, float scale, avec *qv) {
    for (int c = 0; c < AV_C; c++) qv[c] = av_mul(av_load(q + AV_LANES * c), av_set1(scale));
}

/* One head's query as the block functions for format `fmt` (READ_FMT) read it, into qv[QV_N]:
 * scaled fp32 (AV_C vectors), or for bf16 blocks its three bf16 terms (split_q_d64). */
static inline __attribute__((always_inline)) void query_d64(const float *q, float scale, avec *qv, const int fmt) {
#if ATTEND_BF16
    if (fmt == KV_BF16) {
        split_q_d64(q, scale, qv);
        return;
    }
#endif
    (void)fmt;
    scaled_q_d64(q, scale, qv);
}

/* s[t] = qv . k_t for the block's first n keys (token stride `row` bytes; fmt KV_F32 or
 * KV_BF16): 8 keys at a time through reduce8, the rest one by one. */
static inline __attribute__((always_inline)) void block_scores_d64(const avec *qv, const char *kb, size_t row,
                                                                  int n, float *s, const int fmt) {
    const size_t esz = fmt == KV_F32 ? 4 : 2;
    int t = 0;
    for (; t + 8 <= n; t += 8) {
        avec a[8];
#if ATTEND_BF16
        if (fmt == KV_BF16) {
            for (int u = 0; u < 8; u++) a[u] = bf16_dot_d64(qv, kb + (t + u) * row, av_zero());
        } else
#endif
        {
            for (int u = 0; u < 8; u++) a[u] = av_zero();
            for (int c = 0; c < AV_C; c++)
                for (int u = 0; u < 8; u++) a[u] = av_fmadd(qv[c], kvv(kb + (t + u) * row + AV_LANES * c * esz, fmt), a[u]);
        }
        _mm256_storeu_ps(s + t, reduce8(av_fold(a[0]), av_fold(a[1]), av_fold(a[2]), av_fold(a[3]), av_fold(a[4]),
                                        av_fold(a[5]), av_fold(a[6]), av_fold(a[7])));
    }
    for (; t < n; t++) {
        avec a = av_zero();
#if ATTEND_BF16
        if (fmt == KV_BF16) a = bf16_dot_d64(qv, kb + t * row, a);
        else
#endif
            for (int c = 0; c < AV_C; c++) a = av_fmadd(qv[c], kvv(kb + t * row + AV_LANES * c * esz, fmt), a);
        const __m256 f = av_fold(a);
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(f), _mm256_extractf128_ps(f, 1));
        h = _mm_hadd_ps(h, h);
        s[t] = _mm_cvtss_f32(_mm_hadd_ps(h, h));
    }
}

/* acc += sum over the block's first n tokens of p[t] * v_t. At 512 bits, even and odd tokens in
 * two sums (each in token order), added at the block's end, so that two chains of fused adds run
 * at once (one chain of 4 vectors waited on the adds' latency: 19.3 -> 17.5-18.7 ms for 30 layers
 * of 32 rows x 256 keys on one Zen 5 core); at 256 bits, 8 vectors already cover it: one sum in
 * token order (the AVX2 build's results stay what they were). */
static inline __attribute__((always_inline)) void block_values_d64(avec *acc, const float *p, const char *vb,
                                                                  size_t row, int n, const int fmt) {
#if ATTEND_BF16
    if (fmt == KV_BF16) {
        bf16_block_values_d64(acc, p, vb, row, n);
        return;
    }
#endif
    const size_t esz = fmt == KV_F32 ? 4 : 2;
    int t = 0;
#if AV_C == 4
    avec odd[AV_C];
    for (int c = 0; c < AV_C; c++) odd[c] = av_zero();
    for (; t + 2 <= n; t += 2) {
        const avec p0 = av_set1(p[t]), p1 = av_set1(p[t + 1]);
        for (int c = 0; c < AV_C; c++) {
            acc[c] = av_fmadd(p0, kvv(vb + t * row + AV_LANES * c * esz, fmt), acc[c]);
            odd[c] = av_fmadd(p1, kvv(vb + (t + 1) * row + AV_LANES * c * esz, fmt), odd[c]);
        }
    }
#endif
    for (; t < n; t++) {
        const avec p0 = av_set1(p[t]);
        for (int c = 0; c < AV_C; c++) acc[c] = av_fmadd(p0, kvv(vb + t * row + AV_LANES * c * esz, fmt), acc[c]);
    }
#if AV_C == 4
    for (int c = 0; c < AV_C; c++) acc[c] = av_add(acc[c], odd[c]);
#endif
}

/* One block's first n rows of a KV head (D = 64) as the block functions read them (READ_FMT):
 * in place (stride `row` bytes) for fp32, and for bf16 in bf16 vectors; else bf16 widened into
 * buf (n x 64) once for every query head that reads them, not once per head (bf16 -> fp32 is
 * exact: the scores are the same bits). */
static inline __attribute__((always_inline)) const char *as_read(const char *rows, size_t row, int n, const int fmt,
                                                               float *buf, size_t *stride) {
    if (READ_FMT(fmt) == fmt) { /* fp32, or bf16 read in place by the bf16 vectors */
        *stride = row;
        return rows;
    }
    for (int t = 0; t < n; t++)
        for (int c = 0; c < AV_C; c++) av_store(buf + t * 64 + AV_LANES * c, kvv(rows + t * row + 2 * AV_LANES * c, fmt));
    *stride = 64 * sizeof(float);
    return (const char *)buf;
}

/* A query as query_d64 made it (QV_N vectors) from / to memory. */
static inline __attribute__((always_inline)) void load_q_d64(const float *src, avec *qv) {
    for (int i = 0; i < QV_N; i++) qv[i] = av_load(src + (64 / AV_C) * i);
}
static inline __attribute__((always_inline)) void store_q_d64(const avec *qv, float *dst) {
    for (int i = 0; i < QV_N; i++) av_store(dst + (64 / AV_C) * i, qv[i]);
}

/* acc (64 floats in AV_C vectors) from / to memory. */
static inline __attribute__((always_inline)) void load_d64(const float *src, avec *acc) {
    for (int c = 0; c < AV_C; c++) acc[c] = av_load(src + AV_LANES * c);
}
static inline __attribute__((always_inline)) void store_d64(const avec *acc, float *dst) {
    for (int c = 0; c < AV_C; c++) av_store(dst + AV_LANES * c, acc[c]);
}

/* out (64 floats) = acc / sum, acc in the layout of `fmt`'s block functions (READ_FMT). */
static inline void head_out_d64(const avec *acc, float sum, float *out, const int fmt) {
    const avec inv = av_set1(1.f / sum);
#if ATTEND_BF16
    if (fmt == KV_BF16) { /* the pair layout (bf16_block_values_d64) back to dims in order */
        const __m512i i0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
        const __m512i i1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
        for (int c = 0; c < 2; c++) {
            av_store(out + 32 * c, av_mul(_mm512_permutex2var_ps(acc[2 * c], i0, acc[2 * c + 1]), inv));
            av_store(out + 32 * c + 16, av_mul(_mm512_permutex2var_ps(acc[2 * c], i1, acc[2 * c + 1]), inv));
        }
        return;
    }
#endif
    (void)fmt;
    for (int c = 0; c < AV_C; c++) av_store(out + AV_LANES * c, av_mul(acc[c], inv));
}
#endif /* __AVX2__ */
#endif
