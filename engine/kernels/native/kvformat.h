/* The KV cache formats as the C kernels read them (engine/kv/formats.py): fp32, bf16, and
 * 8-bit codes (int8, fp8 e4m3fn) whose (token, head) rows are D codes then an fp32 scale. */
#ifndef PDSERVE_KVFORMAT_H
#define PDSERVE_KVFORMAT_H
#include <stdint.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

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

#ifdef __AVX2__
#ifdef __F16C__
#define FP8_VEC_UNIT 256.f /* kv8's fp8 lanes are the values / 256: the row scales carry the factor */
#else
#define FP8_VEC_UNIT 1.f
#endif

/* kv8's lanes times this are the unscaled values (fp8 through F16C: / 256). */
static inline float kv8_unit(int fmt) { return fmt == KV_FP8 ? FP8_VEC_UNIT : 1.f; }

/* 8 consecutive K/V elements as fp32 (8-bit codes unscaled, over kv8_unit). */
static inline __m256 kv8(const void *p, int fmt) {
    if (fmt == KV_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
    if (fmt == KV_INT8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#ifdef __F16C__
    if (fmt == KV_FP8) { /* e4m3 -> fp16 is a shift (subnormals included), the exponent bias 8 short */
        __m128i h = _mm_slli_epi16(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p)), 7);
        h = _mm_and_si128(h, _mm_set1_epi16((short)0xbfff)); /* the sign extension's extra bit */
        return _mm256_cvtph_ps(h);
    }
#endif
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
#endif
#endif
