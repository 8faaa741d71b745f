/* q8a16.c - Q8_0 weights x int16 activations: y = x @ dequant(W).T, for a GGUF's Q8_0 LM head
 *
 * The LM head is the step's largest matrix (SmolLM2: 49152 x 576, 32 MB in Q8_0). With fp32
 * activations (woq.c) converting each weight to fp32 costs more than reading it: 3.5 ms a row
 * where the read takes 1.9. Here each 32 activations of a row are rounded to int16 with their
 * own scale (max |x| / 32767: a relative error of 1.5e-5 of the largest, where int8's 1/254
 * raised SmolLM2's perplexity 1.7%) and multiplied against the int8 weights with vpmaddwd:
 * 16 multiply-adds per instruction, exact in int32 (a pair sums to at most 2 x 127 x 32767,
 * a group of 32 to at most 16 such pairs, 1.3e8 < 2^31). Per group the integer sum is scaled
 * by d_w * d_x.
 *
 * Weight layout (engine/kernels/native/q8a16.py `pack`), output columns in blocks of 8 (N % 8 == 0):
 *   q int8 (N/8, K/2, 8, 2): column block c, k-pair t, column j, elements 2t, 2t+1
 *   d fp32 (N/8, K/32, 8): the group's scale per column
 * so one 16-byte load sign-extends to 8 columns x 2 weights, and a broadcast of a row's two
 * activations against it gives 8 columns' partial sums in one vpmaddwd. Tiles of 4 rows x 16
 * columns reuse each broadcast for 2 column blocks and each weight vector for 4 rows.
 * Batch invariant: a row's result depends only on that row (same quantization and summation
 * order whatever M, the row's place in a tile, or the thread count). With VNNI (vnni.h)
 * vpdpwssd does the multiply-add and the sum in one instruction, the same int32 sums; built
 * for AVX-512, a column pair's tile runs in 512-bit vectors (tile_pair512).
 */
#include <stdint.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#include "share.h"
#endif
#ifdef __AVX2__
#include <immintrin.h>
#include "vnni.h"
#endif

#ifdef __AVX2__
/* One row: x (K fp32) -> q (K int16) and d (K/32 scales); round to nearest even. */
static void quantize_row(const float *x, int64_t K, int16_t *q, float *d) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t g = 0; g < K / 32; g++) {
        const float *xg = x + g * 32;
        __m256 v[4], mx = _mm256_setzero_ps();
        for (int u = 0; u < 4; u++) {
            v[u] = _mm256_loadu_ps(xg + 8 * u);
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[u]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
        d[g] = amax / 32767.f;
        const __m256 inv = _mm256_set1_ps(amax > 0.f ? 32767.f / amax : 0.f);
        for (int u = 0; u < 4; u += 2) {
            __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(v[u], inv)), b = _mm256_cvtps_epi32(_mm256_mul_ps(v[u + 1], inv));
            /* packs works per 128-bit lane: the permute restores element order */
            __m256i p = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xd8);
            _mm256_storeu_si256((__m256i *)(q + g * 32 + 8 * u), p);
        }
    }
}

/* Where the tiles fetch the next blocks' weights: L2 on AMD CPUs (cpu.py `prefetch_l2`: one row's
 * head 1.01-1.05 -> 0.74 ms on a Zen 4), L1 elsewhere (as measured on Intel). */
#ifdef PDSERVE_PREFETCH_L2
#define HEAD_HINT _MM_HINT_T1
#else
#define HEAD_HINT _MM_HINT_T0
#endif

/* R rows (1..4) x B column blocks (1..2) over all groups, fully unrolled. Per group the int32
 * sums build in registers: each broadcast pair of a row's activations feeds B blocks, each widened
 * weight vector R rows (8 accumulators and 2 weight vectors at 4 x 2: no spills in the inner
 * loop). Then the fp32 sums take them in the one order the kernel defines, whatever the tile:
 * acc = fma(float(isum_g), d_w,g * d_x,g, acc), g ascending, from +0. With `pf` set, each
 * group also prefetches the same group's weights of the next B blocks, so the first rows' tile
 * overlaps the next tile's memory reads (at 1..8 rows the stream, not the arithmetic, is the cost). */
static inline __attribute__((always_inline)) void tile(const int R, const int B, const int16_t *xq, const float *dx,
                                                       int64_t K, const int8_t *wq, const int8_t *pf, const float *dw,
                                                       float *y, int64_t N) {
    const int64_t G = K / 32, wb = K * 8; /* bytes from one column block's weights to the next's */
    const int16_t *xr[4];
    const float *dr[4];
    __m256 acc[4][2];
    for (int r = 0; r < R; r++) {
        xr[r] = xq + r * K, dr[r] = dx + r * G;
        for (int b = 0; b < B; b++) acc[r][b] = _mm256_setzero_ps();
    }
    for (int64_t g = 0; g < G; g++, wq += 256, dw += 8) {
        if (pf)
            for (int b = 0; b < B; b++)
                for (int l = 0; l < 4; l++) _mm_prefetch((const char *)(pf + b * wb + g * 256 + 64 * l), HEAD_HINT);
        __m256i a[4][2];
#pragma GCC unroll 16
        for (int t = 0; t < 16; t++) {
            __m256i wv[2];
            for (int b = 0; b < B; b++)
                wv[b] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wq + b * wb + t * 16)));
            for (int r = 0; r < R; r++) {
                const __m256i xv = _mm256_set1_epi32(*(const int32_t *)(xr[r] + 2 * t));
                for (int b = 0; b < B; b++) {
#ifdef PDSERVE_VNNI
                    a[r][b] = Q8A16_DPWSSD(t ? a[r][b] : _mm256_setzero_si256(), wv[b], xv);
#else
                    const __m256i p = _mm256_madd_epi16(wv[b], xv);
                    a[r][b] = t ? _mm256_add_epi32(a[r][b], p) : p;
#endif
                    /* keeps each sum one chain: gcc otherwise reassociates the unrolled adds into
                     * trees whose products it spills to the stack */
                    __asm__("" : "+x"(a[r][b]));
                }
            }
        }
        for (int r = 0; r < R; r++) {
            const __m256 s = _mm256_set1_ps(*dr[r]++);
            xr[r] += 32;
            for (int b = 0; b < B; b++)
                acc[r][b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[r][b]), _mm256_mul_ps(_mm256_loadu_ps(dw + b * G * 8), s),
                                            acc[r][b]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int b = 0; b < B; b++) _mm256_storeu_ps(y + r * N + b * 8, acc[r][b]);
}

#ifdef PDSERVE_VNNI512
/* tile(R, 2, ...) with the column pair in one 512-bit vector (block c's 8 columns in the low
 * half, c + 1's in the high): each broadcast feeds one vpdpwssd instead of two, and every
 * lane's arithmetic is the 256-bit tile's, so the result is bitwise its. Up to PAIR_ROWS rows:
 * each row's sum is one chain of 16 vpdpwssd a group, so 4 rows kept the multiply-add pipes
 * waiting on the chains' latency (12 rows: the LM head at 32 rows 1.2-1.33x faster on one
 * core of a Xeon, model 207). */
#define PAIR_ROWS 12
static inline __attribute__((always_inline)) void tile_pair512(const int R, const int16_t *xq, const float *dx,
                                                               int64_t K, const int8_t *wq, const int8_t *pf,
                                                               const float *dw, float *y, int64_t N) {
    const int64_t G = K / 32, wb = K * 8;
    const int16_t *xr[PAIR_ROWS];
    const float *dr[PAIR_ROWS];
    __m512 acc[PAIR_ROWS];
    for (int r = 0; r < R; r++) xr[r] = xq + r * K, dr[r] = dx + r * G, acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++, wq += 256, dw += 8) {
        if (pf)
            for (int b = 0; b < 2; b++)
                for (int l = 0; l < 4; l++) _mm_prefetch((const char *)(pf + b * wb + g * 256 + 64 * l), HEAD_HINT);
        __m512i a[PAIR_ROWS];
#pragma GCC unroll 16
        for (int t = 0; t < 16; t++) {
            const __m256i w8 = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(wq + t * 16))),
                                                       _mm_loadu_si128((const __m128i *)(wq + wb + t * 16)), 1);
            const __m512i wv = _mm512_cvtepi8_epi16(w8);
            for (int r = 0; r < R; r++) {
                a[r] = _mm512_dpwssd_epi32(t ? a[r] : _mm512_setzero_si512(), wv,
                                           _mm512_set1_epi32(*(const int32_t *)(xr[r] + 2 * t)));
                __asm__("" : "+v"(a[r])); /* one chain per sum, as in tile() */
            }
        }
        const __m512 dv = w4a8_joinf(dw, dw + G * 8);
        for (int r = 0; r < R; r++) {
            const __m512 s = _mm512_set1_ps(*dr[r]++);
            xr[r] += 32;
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[r]), _mm512_mul_ps(dv, s), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(y + r * N, acc[r]);
}
#endif

/* R and B to constants, so that each tile compiles unrolled. */
static void tile_rows(int64_t R, int B, const int16_t *x, const float *d, int64_t K, const int8_t *w, const int8_t *pf,
                      const float *dw, float *out, int64_t N) {
#define TILE(r, b) tile(r, b, x, d, K, w, pf, dw, out, N)
#ifdef PDSERVE_VNNI512
#define PAIR(r) tile_pair512(r, x, d, K, w, pf, dw, out, N)
    if (B == 2) {
        if (R == 12) PAIR(12);
        else if (R == 8) PAIR(8);
        else if (R == 4) PAIR(4);
        else if (R == 3) PAIR(3);
        else if (R == 2) PAIR(2);
        else PAIR(1);
        return;
    }
#undef PAIR
#endif
    if (B == 2) {
        if (R == 4) TILE(4, 2);
        else if (R == 3) TILE(3, 2);
        else if (R == 2) TILE(2, 2);
        else TILE(1, 2);
    } else {
        if (R == 4) TILE(4, 1);
        else if (R == 3) TILE(3, 1);
        else if (R == 2) TILE(2, 1);
        else TILE(1, 1);
    }
#undef TILE
}

/* Rows of the next tile from `left` rows: up to 4, or for a column pair in 512-bit vectors
 * 12 or 8 (tile_rows' row counts) while that many are left. */
static inline int64_t tile_height(int64_t left, int B) {
#ifdef PDSERVE_VNNI512
    if (B == 2 && left >= 8) /* 12 unless that leaves 4..7 rows: 16 as 8 + 8, not 12 + 4 */
        return left >= 20 || (left >= 12 && left < 16) ? PAIR_ROWS : 8;
#else
    (void)B;
#endif
    return left < 4 ? left : 4;
}

/* Column blocks [c0, c1) for every row: blocks in pairs (a last odd one alone), rows in
 * tiles of `tile_height`; a pair's weights come from memory for its first tile (which
 * prefetches the next pair's) and from cache for the rest. */
static void columns(const int16_t *xq, const float *dx, const int8_t *wq, const float *dw, float *y, int64_t M,
                    int64_t N, int64_t K, int64_t c0, int64_t c1) {
    const int64_t G = K / 32;
    for (int64_t c = c0; c < c1;) {
        const int B = c1 - c >= 2 ? 2 : 1;
        const int8_t *w = wq + c * K * 8, *next = c + 2 * B <= c1 ? w + B * K * 8 : NULL;
        for (int64_t r = 0, n; r < M; r += n) {
            n = tile_height(M - r, B);
            tile_rows(n, B, xq + r * K, dx + r * G, K, w, r ? NULL : next, dw + c * G * 8, y + r * N + c * 8, N);
        }
        c += B;
    }
}
#endif /* __AVX2__ */

int q8a16_available(void) {
#ifdef __AVX2__
    return 1;
#else
    return 0;
#endif
}

/* y (M, N) = x (M, K) @ W.T, W in the layout above; K % 32 == 0, N % 8 == 0. Returns 0, or -1
 * without AVX2 or scratch memory. */
int q8a16_matmul(const float *x, const int8_t *wq, const float *dw, float *y, int64_t M, int64_t N, int64_t K,
                 int nt) {
#ifdef __AVX2__
    if (M <= 0 || N <= 0) return 0;
    const int64_t G = K / 32;
    int16_t *xq = malloc((size_t)(M * K) * sizeof(int16_t));
    float *dx = malloc((size_t)(M * G) * sizeof(float));
    if (!xq || !dx) {
        free(xq);
        free(dx);
        return -1;
    }
    if (nt < 1) nt = 1;
#ifdef _OPENMP
#pragma omp parallel num_threads(nt)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < M; i++) quantize_row(x + i * K, K, xq + i * K, dx + i * G);
        SHARE_COLUMNS(N / 8, columns(xq, dx, wq, dw, y, M, N, K, c0, c1));
    }
#else
    for (int64_t i = 0; i < M; i++) quantize_row(x + i * K, K, xq + i * K, dx + i * G);
    columns(xq, dx, wq, dw, y, M, N, K, 0, N / 8);
#endif
    free(xq);
    free(dx);
    return 0;
#else
    (void)x; (void)wq; (void)dw; (void)y; (void)M; (void)N; (void)K; (void)nt;
    return -1;
#endif
}
