/* w4a8.c - Q4_1 weights x int8 activations: y = x @ dequant(W).T for compute-bound batches
 *
 * At prefill-sized M the fp32 matmul is bound by FMA throughput (8 multiply-adds per
 * instruction on AVX2). Here each 16 activations of a row are quantized to int8 with their
 * own scale (GGUF runtimes use one per 32; per 16 costs ~10% speed and halves the
 * perplexity cost on SmolLM2's MLP down projection, whose inputs have outliers) and
 * multiplied against the weights' 4-bit values with vpmaddubsw: 32 multiply-adds per
 * instruction, exact in integers (a weight is 0..15, an activation -127..127: a pair sums to
 * at most 3810, and the 8 pairs a lane gathers over one half group to at most 15240, inside
 * int16). Per half group the integer sum is scaled by d_w * d_x, and per group the minimum
 * adds m_w * sum(x), with the exact fp32 sum.
 *
 * Weight layout (engine/kernels/native/w4a8.py `pack`), for output columns in blocks of 8 (N % 8 == 0):
 *   q  uint8 (N/8, K/4, 8, 4): column block c, k-quad t, column j, element 4t..4t+3 (0..15)
 *   d, m fp32 (N/8, K/32, 8): the group's scale and minimum per column
 * so one 32-byte load holds 4 consecutive weights of 8 columns, and a broadcast of 4
 * activation bytes against it gives 8 columns' partial sums in one vpmaddubsw (the VNNI
 * layout, without VNNI).
 * Batch invariant: a row's result depends only on that row (its quantization and summation
 * order are the same whatever M or the thread count).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#include "share.h"
#endif
#ifdef __AVX2__
#include <immintrin.h>
#include "vnni.h"
#endif

#define MC 64 /* rows of x per pass over a thread's columns: their int8 copy stays in L2 */

int w4a8_available(void) {
#ifdef __AVX2__
    return 1;
#else
    return 0;
#endif
}

#ifdef __AVX2__
/* Activations are quantized into row quads (rows 4r..4r+3; missing rows of the last quad
 * are zeros), interleaved so that one pointer serves a quad:
 *   q (M/4, K/4, 4, 4) int8: quad, k-quad t, row, elements 4t..4t+3
 *   d (M/4, K/16, 4) fp32: scale of each 16 activations per row
 *   s (M/4, K/32, 4) fp32: exact sum of each 32 (a weight group) per row */

/* Row `row` (0..3) of quad `qi`: x (K fp32) -> its lanes of q, d, s; round to nearest.
 * Not static: step.c's nibble-weight matmul quantizes its activations with it. */
void w4a8_quantize_row(const float *x, int64_t K, int8_t *q, float *d, float *s, int row) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t g = 0; g < K / 32; g++) {
        const float *xg = x + g * 32;
        __m256 v[4], sum = _mm256_setzero_ps(), inv[2];
        for (int u = 0; u < 4; u++) {
            v[u] = _mm256_loadu_ps(xg + 8 * u);
            sum = _mm256_add_ps(sum, v[u]);
        }
        for (int h = 0; h < 2; h++) {
            const __m256 mx = _mm256_max_ps(_mm256_andnot_ps(sign, v[2 * h]), _mm256_andnot_ps(sign, v[2 * h + 1]));
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            const float amax = _mm_cvtss_f32(m4);
            d[(2 * g + h) * 4 + row] = amax / 127.f;
            inv[h] = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
        }
        __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
        s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        s[g * 4 + row] = _mm_cvtss_f32(_mm_add_ss(s4, _mm_movehdup_ps(s4)));
        __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v[0], inv[0])), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v[1], inv[0]));
        __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v[2], inv[1])), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v[3], inv[1]));
        /* packs work per 128-bit lane: the permute restores element order */
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
        int32_t e[8];
        _mm256_storeu_si256((__m256i *)e, _mm256_permutevar8x32_epi32(p, perm));
        for (int t = 0; t < 8; t++) ((int32_t *)q)[(g * 8 + t) * 4 + row] = e[t];
    }
}

/* One row quad x 8 columns (one column block): y rows get `rows` (1..4) of the 4 results. */
static void tile(const int8_t *xq, const float *dx, const float *sx, int64_t K, const uint8_t *wq,
                 const float *dw, const float *mw, float *y, int64_t N, int rows) {
    const int64_t G = K / 32;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
    for (int64_t g = 0; g < G; g++, wq += 256, xq += 128, dx += 8, sx += 4) {
        const __m256 dv = _mm256_loadu_ps(dw + g * 8), mv = _mm256_loadu_ps(mw + g * 8);
        for (int h = 0; h < 2; h++) { /* the group's two halves: 16 activations per scale */
            const uint8_t *w = wq + h * 128;
            const int8_t *xp = xq + h * 64;
            __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
#define STEP(t)                                                                                         \
    {                                                                                                   \
        const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + (t) * 32));                         \
        a0 = _mm256_add_epi16(a0, _mm256_maddubs_epi16(wv, _mm256_set1_epi32(*(const int32_t *)(xp + (t) * 16))));      \
        a1 = _mm256_add_epi16(a1, _mm256_maddubs_epi16(wv, _mm256_set1_epi32(*(const int32_t *)(xp + (t) * 16 + 4))));  \
        a2 = _mm256_add_epi16(a2, _mm256_maddubs_epi16(wv, _mm256_set1_epi32(*(const int32_t *)(xp + (t) * 16 + 8))));  \
        a3 = _mm256_add_epi16(a3, _mm256_maddubs_epi16(wv, _mm256_set1_epi32(*(const int32_t *)(xp + (t) * 16 + 12)))); \
    }
            STEP(0) STEP(1) STEP(2) STEP(3)
#undef STEP
            const float *d = dx + h * 4;
            acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(a0, ones)), _mm256_mul_ps(dv, _mm256_broadcast_ss(d)), acc0);
            acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(a1, ones)), _mm256_mul_ps(dv, _mm256_broadcast_ss(d + 1)), acc1);
            acc2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(a2, ones)), _mm256_mul_ps(dv, _mm256_broadcast_ss(d + 2)), acc2);
            acc3 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(a3, ones)), _mm256_mul_ps(dv, _mm256_broadcast_ss(d + 3)), acc3);
        }
        acc0 = _mm256_fmadd_ps(mv, _mm256_broadcast_ss(sx), acc0);
        acc1 = _mm256_fmadd_ps(mv, _mm256_broadcast_ss(sx + 1), acc1);
        acc2 = _mm256_fmadd_ps(mv, _mm256_broadcast_ss(sx + 2), acc2);
        acc3 = _mm256_fmadd_ps(mv, _mm256_broadcast_ss(sx + 3), acc3);
    }
    _mm256_storeu_ps(y, acc0);
    if (rows > 1) _mm256_storeu_ps(y + N, acc1);
    if (rows > 2) _mm256_storeu_ps(y + 2 * N, acc2);
    if (rows > 3) _mm256_storeu_ps(y + 3 * N, acc3);
}

/* Column blocks [c0, c1) for every row quad of the quantized x (with VNNI: vnni.h's
 * tiles, the same result). */
static void columns(const int8_t *xq, const float *dx, const float *sx, const uint8_t *wq, const float *dw,
                    const float *mw, float *y, int64_t M, int64_t N, int64_t K, int64_t c0, int64_t c1) {
#ifdef PDSERVE_VNNI
    w4a8_columns_vnni(xq, dx, sx, wq, dw, mw, y, M, N, K, c0, c1, MC / 4, 0, 0);
    return;
#endif
    const int64_t G = K / 32, quads = (M + 3) / 4;
    for (int64_t r0 = 0; r0 < quads; r0 += MC / 4) {
        const int64_t r1 = r0 + MC / 4 < quads ? r0 + MC / 4 : quads;
        for (int64_t c = c0; c < c1; c++)
            for (int64_t r = r0; r < r1; r++) {
                const int rows = M - 4 * r < 4 ? (int)(M - 4 * r) : 4;
                tile(xq + r * 4 * K, dx + r * 8 * G, sx + r * 4 * G, K, wq + c * K * 8, dw + c * G * 8,
                     mw + c * G * 8, y + 4 * r * N + c * 8, N, rows);
            }
    }
}
#endif /* __AVX2__ */

#ifdef __AVX2__
/* The matmul around a column routine: x quantized into quads (every thread a share of the
 * rows), then the column blocks in chunks (share.h) through `cols` (`columns` above, or
 * w4a8n.c's over nibble-packed weights). Returns 0, or -1 without scratch memory. */
typedef void (*w4a8_cols_fn)(const int8_t *, const float *, const float *, const uint8_t *, const float *,
                             const float *, float *, int64_t, int64_t, int64_t, int64_t, int64_t);

int w4a8_drive(const float *x, const uint8_t *wq, const float *dw, const float *mw, float *y, int64_t M, int64_t N,
               int64_t K, int nt, w4a8_cols_fn cols) {
    if (M <= 0 || N <= 0) return 0;
    const int64_t G = K / 32, Mp = (M + 3) / 4 * 4;
    int8_t *xq = aligned_alloc(64, ((size_t)(Mp * K) + 63) & ~(size_t)63);
    float *dx = calloc((size_t)(Mp * G * 3), sizeof(float));
    if (!xq || !dx) {
        free(xq);
        free(dx);
        return -1;
    }
    float *sx = dx + 2 * Mp * G;
    if (Mp > M) memset(xq + (Mp - 4) * K, 0, (size_t)(4 * K)); /* the last quad's missing rows: zeros */
    if (nt < 1) nt = 1;
#ifdef _OPENMP
#pragma omp parallel num_threads(nt)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < M; i++)
            w4a8_quantize_row(x + i * K, K, xq + i / 4 * 4 * K, dx + i / 4 * 8 * G, sx + i / 4 * 4 * G, (int)(i % 4));
        SHARE_COLUMNS(N / 8, cols(xq, dx, sx, wq, dw, mw, y, M, N, K, c0, c1));
    }
#else
    for (int64_t i = 0; i < M; i++)
        w4a8_quantize_row(x + i * K, K, xq + i / 4 * 4 * K, dx + i / 4 * 8 * G, sx + i / 4 * 4 * G, (int)(i % 4));
    cols(xq, dx, sx, wq, dw, mw, y, M, N, K, 0, N / 8);
#endif
    free(xq);
    free(dx);
    return 0;
}
#endif /* __AVX2__ */

/* y (M, N) = x (M, K) @ W.T, W in the layout above; K % 32 == 0, N % 8 == 0. Returns 0, or -1
 * without AVX2 or scratch memory. */
int w4a8_matmul(const float *x, const uint8_t *wq, const float *dw, const float *mw, float *y,
                int64_t M, int64_t N, int64_t K, int nt) {
#ifdef __AVX2__
    return w4a8_drive(x, wq, dw, mw, y, M, N, K, nt, columns);
#else
    (void)x; (void)wq; (void)dw; (void)mw; (void)y; (void)M; (void)N; (void)K; (void)nt;
    return -1;
#endif
}
