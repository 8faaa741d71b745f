/* peak.c - this CPU's arithmetic peak, measured, for the roof a kernel's rate is set against
 * (bench/prefill_roof.py): independent chains of the widest integer multiply-add the build has
 * (vpdpbusd on 512 or 256 bits with VNNI; vpmaddubsw then vpaddw on AVX2, as w4a8.c sums) and
 * of fp32 fused multiply-adds (512 or 256 bits), on nt threads, registers only. 12 chains a
 * thread: more than the multiply-adds' latency times the pipes that run them, so the count per
 * second is the pipes' throughput. Each returns the multiply-adds done (iters per thread). */
#include <stdint.h>
#ifdef __AVX2__
#include <immintrin.h>
#include "vnni.h"
#endif

#define CHAINS 12
/* The chains as 12 named registers (an array of them lived on the stack) */
#define ALL(M) M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7) M(8) M(9) M(10) M(11)
#define DECL(i) V a##i = INIT(i);
#define STEP(i) a##i = OP(a##i); __asm__ volatile("" : "+v"(a##i));
#define CHAIN_LOOP(iters) \
    ALL(DECL)                                   \
    for (int64_t i = 0; i < (iters); i++) { ALL(STEP) }

int64_t peak_int8_macs(int64_t iters, int nt) {
#ifdef __AVX2__
    int64_t per = 0;
#pragma omp parallel num_threads(nt) reduction(+ : per)
    {
#ifdef PDSERVE_VNNI512
        typedef __m512i V;
        const __m512i w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(-2);
#define INIT(i) _mm512_set1_epi32(i)
#define OP(a) _mm512_dpbusd_epi32((a), w, x)
        CHAIN_LOOP(iters)
        per += (int64_t)CHAINS * 64 * iters;
#elif defined(PDSERVE_VNNI)
        typedef __m256i V;
        const __m256i w = _mm256_set1_epi8(3), x = _mm256_set1_epi8(-2);
#define INIT(i) _mm256_set1_epi32(i)
#define OP(a) W4A8_DPBUSD((a), w, x)
        CHAIN_LOOP(iters)
        per += (int64_t)CHAINS * 32 * iters;
#else
        typedef __m256i V;
        const __m256i w = _mm256_set1_epi8(3);
#define INIT(i) _mm256_set1_epi16(i)
#define OP(a) _mm256_add_epi16((a), _mm256_maddubs_epi16(w, (a))) /* the product on the chain: not hoisted */
        CHAIN_LOOP(iters)
        per += (int64_t)CHAINS * 32 * iters;
#endif
#undef INIT
#undef OP
    }
    return per;
#else
    (void)iters; (void)nt;
    return 0;
#endif
}

int64_t peak_fp32_fmas(int64_t iters, int nt) {
#ifdef __AVX2__
    int64_t per = 0;
#pragma omp parallel num_threads(nt) reduction(+ : per)
    {
#ifdef __AVX512F__
        typedef __m512 V;
        const __m512 m = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-3f);
#define INIT(i) _mm512_set1_ps((float)(i))
#define OP(a) _mm512_fmadd_ps((a), m, b)
        CHAIN_LOOP(iters)
        per += (int64_t)CHAINS * 16 * iters;
#else
        typedef __m256 V;
        const __m256 m = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(1e-3f);
#define INIT(i) _mm256_set1_ps((float)(i))
#define OP(a) _mm256_fmadd_ps((a), m, b)
        CHAIN_LOOP(iters)
        per += (int64_t)CHAINS * 8 * iters;
#endif
#undef INIT
#undef OP
    }
    return per;
#else
    (void)iters; (void)nt;
    return 0;
#endif
}
