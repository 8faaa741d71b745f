/* woq.c - weight-only quantized matmul for decode-sized batches: y = x @ dequant(W).T
 *
 * x fp32 (M, K) row-major, y fp32 (M, N) row-major, W quantized (N, K), M ~ 1..16.
 * At these M the step is bound by reading W, so W is streamed once per call: each weight
 * vector is loaded and converted to fp32 once and used for every row of x (register tile of
 * NR weight rows x MR x rows). Above 8 rows of x the converted rows also go to a small
 * per-thread fp32 buffer (L1) that the later chunks of x rows read back.
 * A row's result never depends on the other rows (same summation order whatever M): batch
 * invariant, as the engine's other kernels.
 *
 * Formats
 *   int8 : q int8 (N, K); w[n][k] = q[n][k] * s[n]                         (symmetric)
 *   q8_0 : q int8 (N, K), d fp32 (N, K/32); w[n][k] = q[n][k] * d[n][k/32]  (GGUF's Q8_0)
 *   q4_1 : p uint8 (N, K/2), d, m fp32 (N, K/32); w[n][k] = q * d[n][g] + m[n][g], g = k/32,
 *          GGUF's nibble order: byte 16g + j holds element 32g + j (low nibble) and 32g + 16 + j
 *          (high). 8 bytes -> vpmovzxbd -> "and 15" and "shift right 4" give 16 elements in 4
 *          ops; the same layout suits AVX-512 (16 bytes -> one zmm) and repacking GGUF files.
 * Dequantizing whole rows into a buffer first and running one fp32 kernel on it was measured
 * too: 30-40% slower at M = 1..4 than converting inside the tile, as here.
 * Threads: OpenMP over N in contiguous row ranges. The process already has torch's libgomp
 * loaded (same soname), so this library binds to it and shares torch's thread pool. A private
 * spin-then-futex pthread pool was measured: 0.8 us less per call alone, but with torch ops
 * between the calls (as in a model) its spinning workers and torch's fought over the 2 cores:
 * 250 ms per step instead of 6.
 */
#include <stdint.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define INLINE static inline __attribute__((always_inline))
#define MRMAX 8 /* x rows per register tile */
enum { DIRECT, STORE, FROMBUF }; /* weight source of a tile: packed, packed+save fp32, fp32 buffer */

int woq_has_avx2(void) {
#ifdef __AVX2__
    return 1;
#else
    return 0;
#endif
}

#ifdef __AVX2__
INLINE float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* NR int8 weight rows x MR x rows. Constant NR/MR/mode/grouped after inlining: acc stays in
 * registers. grouped: q8_0 (each 8 weights scaled by their group's d as converted; K % 32 == 0),
 * else one scale per row applied to the sums. */
INLINE void i8_tile(const int NR, const int MR, const int mode, const int grouped, const float *x, int64_t K,
                    const int8_t *w, float *buf, const float *s, float *y, int64_t N) {
    __m256 acc[4][MRMAX]; /* fixed sizes (not VLAs), so the unrolled accesses become registers */
    for (int r = 0; r < NR; r++)
        for (int i = 0; i < MR; i++) acc[r][i] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 wv[4];
        for (int r = 0; r < NR; r++) {
            if (mode == FROMBUF) {
                wv[r] = _mm256_loadu_ps(buf + r * K + k);
            } else {
                /* the next tile's rows, a cache line at a time: the hardware prefetcher alone
                 * streamed ~12 GB/s per core here, with this ~25 */
                if ((k & 63) == 0) _mm_prefetch((const char *)(w + (r + NR) * K + k), _MM_HINT_T0);
                __m128i b = _mm_loadl_epi64((const __m128i *)(w + r * K + k));
                wv[r] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
                if (grouped) wv[r] = _mm256_mul_ps(wv[r], _mm256_broadcast_ss(s + r * (K / 32) + k / 32));
                if (mode == STORE) _mm256_storeu_ps(buf + r * K + k, wv[r]);
            }
        }
        for (int i = 0; i < MR; i++) {
            __m256 xv = _mm256_loadu_ps(x + i * K + k);
            for (int r = 0; r < NR; r++) acc[r][i] = _mm256_fmadd_ps(wv[r], xv, acc[r][i]);
        }
    }
    for (int r = 0; r < NR; r++)
        for (int i = 0; i < MR; i++) {
            float t = hsum(acc[r][i]);
            if (grouped) { /* K % 32 == 0: no tail */
                y[i * N + r] = t;
                continue;
            }
            for (int64_t kk = k; kk < K; kk++) t += x[i * K + kk] * (float)w[r * K + kk];
            y[i * N + r] = t * s[r];
        }
}

/* NR q4_1 weight rows x MR x rows; K % 32 == 0. Each 8 bytes of a group's 16 take one vpmovzxbd
 * load: 8 int32 lanes holding (lo | hi << 4); "and 15" gives elements 8h..8h+7 of the group,
 * "shift right 4" elements 16+8h..16+8h+7 (GGUF order). Dequantized with one FMA: q * d + m. */
INLINE void q4_tile(const int NR, const int MR, const int mode, const float *x, int64_t K,
                    const uint8_t *p, const float *d, const float *m, float *buf, float *y, int64_t N) {
    const __m256i low4 = _mm256_set1_epi32(15);
    const int64_t G = K / 32;
    __m256 acc[4][MRMAX]; /* fixed sizes (not VLAs), so the unrolled accesses become registers */
    for (int r = 0; r < NR; r++)
        for (int i = 0; i < MR; i++) acc[r][i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        for (int h = 0; h < 2; h++) {
            const int64_t k = g * 32 + h * 8; /* elements k..k+7 (low nibbles), k+16..k+23 (high) */
            for (int r = 0; r < NR; r++) { /* one row at a time: 2 weight registers live, not 2 * NR */
                __m256 w0, w1;
                if (mode == FROMBUF) {
                    w0 = _mm256_loadu_ps(buf + r * K + k);
                    w1 = _mm256_loadu_ps(buf + r * K + k + 16);
                } else {
                    const uint8_t *src = p + r * (K / 2) + g * 16 + h * 8;
                    if (h == 0 && (g & 3) == 0) _mm_prefetch((const char *)(src + NR * (K / 2)), _MM_HINT_T0);
                    const __m256i t = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)src));
                    const __m256 dv = _mm256_broadcast_ss(d + r * G + g), mv = _mm256_broadcast_ss(m + r * G + g);
                    w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(t, low4)), dv, mv);
                    w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(t, 4)), dv, mv);
                    if (mode == STORE) {
                        _mm256_storeu_ps(buf + r * K + k, w0);
                        _mm256_storeu_ps(buf + r * K + k + 16, w1);
                    }
                }
                for (int i = 0; i < MR; i++) {
                    acc[r][i] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + i * K + k), acc[r][i]);
                    acc[r][i] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + i * K + k + 16), acc[r][i]);
                }
            }
        }
    }
    for (int r = 0; r < NR; r++)
        for (int i = 0; i < MR; i++) y[i * N + r] = hsum(acc[r][i]);
}

/* Register tile height for MR x rows: NR*MR accumulators <= 12 of the 16 ymm registers, and
 * >= 4 independent FMA chains at M = 1 (FMA latency 4); 2 weight rows at M > 16 halve x loads. */
static int nr_for(int mr) { return mr <= 2 ? 4 : mr <= 6 ? 2 : 1; }

/* The (NR, MR, mode) specialisations run_rows uses, each a fully unrolled copy (compile time
 * grows with their number: ~1 s for these): M <= 8 is one DIRECT chunk under NR = nr_for(M);
 * larger M is split into chunks of mrmax (the first, STORE) or mrmax - 1 rows, mrmax in 5..8,
 * all under NR = nr_for(mrmax). */
#define SPECS(T) T(4, 1, DIRECT) T(4, 2, DIRECT) T(2, 3, DIRECT) T(2, 4, DIRECT) T(2, 5, DIRECT) \
    T(2, 6, DIRECT) T(1, 7, DIRECT) T(1, 8, DIRECT) \
    T(2, 5, STORE) T(2, 6, STORE) T(1, 7, STORE) T(1, 8, STORE) \
    T(2, 4, FROMBUF) T(2, 5, FROMBUF) T(2, 6, FROMBUF) T(1, 6, FROMBUF) T(1, 7, FROMBUF) T(1, 8, FROMBUF)
#define KEY(NR_, MR_, MODE_) ((MODE_) * 64 + (NR_) * 16 + (MR_))
#define I8(NR_, MR_, MODE_) case KEY(NR_, MR_, MODE_): i8_tile(NR_, MR_, MODE_, 0, x, K, w, buf, s, y, N); return;
#define Q8(NR_, MR_, MODE_) case KEY(NR_, MR_, MODE_): i8_tile(NR_, MR_, MODE_, 1, x, K, w, buf, s, y, N); return;
#define Q4(NR_, MR_, MODE_) case KEY(NR_, MR_, MODE_): q4_tile(NR_, MR_, MODE_, x, K, p, d, m, buf, y, N); return;

static void i8_dispatch(int key, const float *x, int64_t K, const int8_t *w, float *buf, const float *s,
                        float *y, int64_t N) {
    switch (key) { SPECS(I8) default: abort(); }
}
static void q8_dispatch(int key, const float *x, int64_t K, const int8_t *w, float *buf, const float *s,
                        float *y, int64_t N) {
    switch (key) { SPECS(Q8) default: abort(); }
}
static void q4_dispatch(int key, const float *x, int64_t K, const uint8_t *p, const float *d, const float *m,
                        float *buf, float *y, int64_t N) {
    switch (key) { SPECS(Q4) default: abort(); }
}
#endif /* __AVX2__ */

/* Scalar rows [n0, n1): the whole kernel without AVX2, else only ranges narrower than a tile. */
static void scalar_rows(int fmt, const float *x, const void *w, const float *s, const float *mn, float *y,
                        int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++)
        for (int64_t i = 0; i < M; i++) {
            float t = 0.f;
            for (int64_t k = 0; k < K; k++) {
                float wk;
                if (fmt == 0) {
                    wk = (float)((const int8_t *)w)[n * K + k];
                } else if (fmt == 2) {
                    wk = (float)((const int8_t *)w)[n * K + k] * s[n * (K / 32) + k / 32];
                } else {
                    const int64_t g = n * (K / 32) + k / 32, j = k % 32;
                    const uint8_t b = ((const uint8_t *)w)[16 * g + j % 16];
                    wk = (float)(j < 16 ? b & 15 : b >> 4) * s[g] + mn[g];
                }
                t += x[i * K + k] * wk;
            }
            y[i * N + n] = fmt == 0 ? t * s[n] : t;
        }
}

/* Output rows [n0, n1) of one call: the per-thread unit of work. fmt 0 = int8, 1 = q4_1, 2 = q8_0. */
static void run_rows(int fmt, const float *x, const void *w, const float *s, const float *mn, float *y,
                     int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
#ifdef __AVX2__
    /* x rows in near-equal chunks of <= 8 rows (<= 6 above 16 rows: two weight rows per tile then
     * halve the x loads, which spill out of L1 there: 1.6x at M = 32); the row block height is
     * fixed by the largest chunk. */
    const int chunks = (int)(M <= 2 * MRMAX ? (M + MRMAX - 1) / MRMAX : (M + 5) / 6);
    const int mrmax = (int)((M + chunks - 1) / chunks);
    const int nr = nr_for(mrmax);
    float *buf = chunks > 1 ? aligned_alloc(32, ((size_t)nr * K * 4 + 63) & ~(size_t)31) : NULL;
    if (n1 - n0 < 4 || (chunks > 1 && !buf)) { /* < 4 whatever nr is: the path must not depend on M */
        scalar_rows(fmt, x, w, s, mn, y, M, N, K, n0, n1);
        return;
    }
    for (int64_t n = n0; n < n1; n += nr) {
        if (n + nr > n1) n = n1 - nr; /* last block: overlap the previous one (same values rewritten) */
        for (int64_t m0 = 0, c = 0; m0 < M; c++) {
            const int mr = (int)((M - m0 + (chunks - c) - 1) / (chunks - c));
            const int key = KEY(nr, mr, chunks == 1 ? DIRECT : c == 0 ? STORE : FROMBUF);
            if (fmt == 0)
                i8_dispatch(key, x + m0 * K, K, (const int8_t *)w + n * K, buf, s + n, y + m0 * N + n, N);
            else if (fmt == 2)
                q8_dispatch(key, x + m0 * K, K, (const int8_t *)w + n * K, buf, s + n * (K / 32), y + m0 * N + n, N);
            else
                q4_dispatch(key, x + m0 * K, K, (const uint8_t *)w + n * (K / 2), s + n * (K / 32),
                            mn + n * (K / 32), buf, y + m0 * N + n, N);
            m0 += mr;
        }
    }
    free(buf);
#else
    scalar_rows(fmt, x, w, s, mn, y, M, N, K, n0, n1);
#endif
}

/* Split N into nt contiguous ranges (multiples of 4 rows, so tiles stay full); small calls run
 * on the calling thread, where a fork/join would cost more than it saves. */
static void run(int fmt, const float *x, const void *w, const float *s, const float *mn, float *y,
                int64_t M, int64_t N, int64_t K, int nt) {
    if (M <= 0 || N <= 0) return;
    if (nt < 1 || N * K < (1 << 16)) nt = 1;
#ifdef _OPENMP
    if (nt > 1) {
#pragma omp parallel num_threads(nt)
        {
            const int t = omp_get_thread_num(), T = omp_get_num_threads();
            const int64_t blocks = (N + 3) / 4;
            int64_t n0 = blocks * t / T * 4, n1 = blocks * (t + 1) / T * 4;
            if (n1 > N) n1 = N;
            if (n0 < n1) run_rows(fmt, x, w, s, mn, y, M, N, K, n0, n1);
        }
        return;
    }
#endif
    run_rows(fmt, x, w, s, mn, y, M, N, K, 0, N);
}

void woq_int8_matmul(const float *x, const int8_t *q, const float *scale, float *y,
                     int64_t M, int64_t N, int64_t K, int nt) {
    run(0, x, q, scale, NULL, y, M, N, K, nt);
}

void woq_q8_0_matmul(const float *x, const int8_t *q, const float *d, float *y,
                     int64_t M, int64_t N, int64_t K, int nt) {
    run(2, x, q, d, NULL, y, M, N, K, nt);
}

void woq_q4_1_matmul(const float *x, const uint8_t *packed, const float *d, const float *m, float *y,
                     int64_t M, int64_t N, int64_t K, int nt) {
    run(1, x, packed, d, m, y, M, N, K, nt);
}
