/* The KV cache formats as the C kernels read them (engine/kv/formats.py): fp32, bf16, and
 * 8-bit codes (int8, fp8 e4m3fn) whose (token, head) rows are D codes then an fp32 scale. */
#ifndef PDSERVE_KVFORMAT_H
#define PDSERVE_KVFORMAT_H
#include <math.h>
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

/* One (token, head) row of D floats as an 8-bit row (KV_INT8 / KV_FP8): the codes of x / scale,
 * scale = absmax / qmax (1 for an all-zero row), then the scale -- bit for bit what
 * kv_format.encode_reference writes with torch ops. */
static inline void kv_encode_row(const float *src, uint8_t *dst, int D, int fmt) {
    const float qmax = fmt == KV_INT8 ? 127.f : 448.f;
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
