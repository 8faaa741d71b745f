/* Vector math shared by the C kernels (AVX2 + FMA builds only). */
#ifndef PDSERVE_VECMATH_H
#define PDSERVE_VECMATH_H
#include <immintrin.h>

/* exp(x), 8 lanes: x = n ln2 + r with |r| <= ln2/2, exp(r) by a degree-6 polynomial
 * (relative error ~2e-7, as libm's expf to within 1-2 ulp), times 2^n built in the exponent
 * bits. x is clamped to [-87, 88]: below, the result flushes to ~0 (true value < 2e-38),
 * above, it saturates near FLT_MAX. A NaN stays NaN (max/min return their 2nd operand). */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_set1_ps(88.0f), _mm256_max_ps(_mm256_set1_ps(-87.0f), x));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x); /* ln2 split in two: exact n*hi */
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    /* 2^n in two factors: n reaches 127 at x = 88, one past the largest normal exponent */
    __m256i half = _mm256_srai_epi32(_mm256_cvtps_epi32(n), 1);
    __m256i rest = _mm256_sub_epi32(_mm256_cvtps_epi32(n), half);
    __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, _mm256_set1_epi32(127)), 23));
    __m256 e2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(rest, _mm256_set1_epi32(127)), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, e1), e2);
}
#endif
