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

int64_t peak_int8_macs(int64_t iters, int nt) {
#ifdef __AVX2__
    int64_t per = 0;
#pragma omp parallel num_threads(nt) reduction(+ : per)
    {
#ifdef PDSERVE_VNNI512
        __m512i acc[CHAINS];
        const __m512i w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(-2);
        for (int c = 0; c < CHAINS; c++) acc[c] = _mm512_set1_epi32(c);
        for (int64_t i = 0; i < iters; i++)
            for (int c = 0; c < CHAINS; c++) {
                acc[c] = _mm512_dpbusd_epi32(acc[c], w, x);
                __asm__ volatile("" : "+v"(acc[c]));
            }
        per += (int64_t)CHAINS * 64 * iters;
#elif defined(PDSERVE_VNNI)
        __m256i acc[CHAINS];
        const __m256i w = _mm256_set1_epi8(3), x = _mm256_set1_epi8(-2);
        for (int c = 0; c < CHAINS; c++) acc[c] = _mm256_set1_epi32(c);
        for (int64_t i = 0; i < iters; i++)
            for (int c = 0; c < CHAINS; c++) {
                acc[c] = W4A8_DPBUSD(acc[c], w, x);
                __asm__ volatile("" : "+x"(acc[c]));
            }
        per += (int64_t)CHAINS * 32 * iters;
#else
        __m256i acc[CHAINS];
        const __m256i w = _mm256_set1_epi8(3), x = _mm256_set1_epi8(-2);
        for (int c = 0; c < CHAINS; c++) acc[c] = _mm256_set1_epi16((short)c);
        for (int64_t i = 0; i < iters; i++)
            for (int c = 0; c < CHAINS; c++) {
                acc[c] = _mm256_add_epi16(acc[c], _mm256_maddubs_epi16(w, x));
                __asm__ volatile("" : "+x"(acc[c]));
            }
        per += (int64_t)CHAINS * 32 * iters;
#endif
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
        __m512 acc[CHAINS];
        const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-3f);
        for (int c = 0; c < CHAINS; c++) acc[c] = _mm512_set1_ps((float)c);
        for (int64_t i = 0; i < iters; i++)
            for (int c = 0; c < CHAINS; c++) {
                acc[c] = _mm512_fmadd_ps(acc[c], a, b);
                __asm__ volatile("" : "+v"(acc[c]));
            }
        per += (int64_t)CHAINS * 16 * iters;
#else
        __m256 acc[CHAINS];
        const __m256 a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(1e-3f);
        for (int c = 0; c < CHAINS; c++) acc[c] = _mm256_set1_ps((float)c);
        for (int64_t i = 0; i < iters; i++)
            for (int c = 0; c < CHAINS; c++) {
                acc[c] = _mm256_fmadd_ps(acc[c], a, b);
                __asm__ volatile("" : "+x"(acc[c]));
            }
        per += (int64_t)CHAINS * 8 * iters;
#endif
    }
    return per;
#else
    (void)iters; (void)nt;
    return 0;
#endif
}
