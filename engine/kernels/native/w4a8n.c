/* w4a8n.c - Q4_1 weights x int8 activations over nibble-packed weights, for the decode step
 *
 * w4a8.c holds one byte per 4-bit weight (its vpmaddubsw reads bytes). A decode step is
 * bound by reading the weights, so here two of its 32-byte vectors share one: k-quads 2p and
 * 2p+1 of a column block in the low and high nibbles (step.py `nibbles` packs them; 0.5 byte
 * per weight plus the scales), split back into w4a8.c's vectors with a shift and two masks.
 * Everything else is w4a8.c's arithmetic in its order (the integer sums, then the fp32
 * scaling per half group and the minimum per group), so y is bitwise w4a8_matmul's.
 *   wn uint8 (N/8, K/8, 32): byte [c, p, 4j + e] = q[c, 2p, j, e] | q[c, 2p + 1, j, e] << 4
 * The scales and minima are w4a8.c's fp32 d and m, or (the `_h` forms, builds with
 * W4A8_HALF_SCALES) the same values in fp16, a group's 8 scales and 8 minima side by side
 *   dm fp16 (N/8, K/32, 2, 8)
 * (step.py `half_scales`, for a model whose d and m are all fp16 values): a one-row step reads
 * 20 bytes per 32 weights instead of 24, and the widened values, and so y, are the same.
 * step.c calls w4a8n_columns(_h) inside its own parallel region (the one-region schedule).
 */
#include <stdint.h>

#ifdef __AVX2__
#include <immintrin.h>
#include "vnni.h"

typedef void (*w4a8_cols_fn)(const int8_t *, const float *, const float *, const uint8_t *, const float *,
                             const float *, float *, int64_t, int64_t, int64_t, int64_t, int64_t);
int w4a8_drive(const float *x, const uint8_t *wq, const float *dw, const float *mw, float *y, int64_t M, int64_t N,
               int64_t K, int nt, w4a8_cols_fn cols); /* w4a8.c */

/* One row quad x one column block; R = 1 (only the quad's first row is real: the others'
 * sums are skipped, row 0's are computed as for R = 4) or 4. */
static inline __attribute__((always_inline)) void tile_nib(const int8_t *xq, const float *dx, const float *sx,
                                                           int64_t K, const uint8_t *wn, const float *dw,
                                                           const float *mw, float *y, int64_t N, int rows,
                                                           const int R, const int hs) {
    const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(15);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
    for (int64_t g = 0; g < K / 32; g++, wn += 128, xq += 128, dx += 8, sx += 4) {
        __m256 dv, mv;
        w4a8_scales(dw, mw, g, hs, &dv, &mv);
        for (int h = 0; h < 2; h++) {
            const __m256i v0 = _mm256_loadu_si256((const __m256i *)(wn + h * 64));
            const __m256i v1 = _mm256_loadu_si256((const __m256i *)(wn + h * 64 + 32));
            const __m256i wv[4] = {_mm256_and_si256(v0, low), _mm256_and_si256(_mm256_srli_epi16(v0, 4), low),
                                   _mm256_and_si256(v1, low), _mm256_and_si256(_mm256_srli_epi16(v1, 4), low)};
            const int8_t *xp = xq + h * 64;
            __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
            for (int t = 0; t < 4; t++) {
                a0 = _mm256_add_epi16(a0, _mm256_maddubs_epi16(wv[t], _mm256_set1_epi32(*(const int32_t *)(xp + t * 16))));
                if (R == 1) continue;
                a1 = _mm256_add_epi16(a1, _mm256_maddubs_epi16(wv[t], _mm256_set1_epi32(*(const int32_t *)(xp + t * 16 + 4))));
                a2 = _mm256_add_epi16(a2, _mm256_maddubs_epi16(wv[t], _mm256_set1_epi32(*(const int32_t *)(xp + t * 16 + 8))));
                a3 = _mm256_add_epi16(a3, _mm256_maddubs_epi16(wv[t], _mm256_set1_epi32(*(const int32_t *)(xp + t * 16 + 12))));
            }
            const float *d = dx + h * 4;
            acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(a0, ones)), _mm256_mul_ps(dv, _mm256_broadcast_ss(d)), acc0);
            if (R == 1) continue;
            acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(a1, ones)), _mm256_mul_ps(dv, _mm256_broadcast_ss(d + 1)), acc1);
            acc2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(a2, ones)), _mm256_mul_ps(dv, _mm256_broadcast_ss(d + 2)), acc2);
            acc3 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(a3, ones)), _mm256_mul_ps(dv, _mm256_broadcast_ss(d + 3)), acc3);
        }
        acc0 = _mm256_fmadd_ps(mv, _mm256_broadcast_ss(sx), acc0);
        if (R == 1) continue;
        acc1 = _mm256_fmadd_ps(mv, _mm256_broadcast_ss(sx + 1), acc1);
        acc2 = _mm256_fmadd_ps(mv, _mm256_broadcast_ss(sx + 2), acc2);
        acc3 = _mm256_fmadd_ps(mv, _mm256_broadcast_ss(sx + 3), acc3);
    }
    _mm256_storeu_ps(y, acc0);
    if (rows > 1) _mm256_storeu_ps(y + N, acc1);
    if (rows > 2) _mm256_storeu_ps(y + 2 * N, acc2);
    if (rows > 3) _mm256_storeu_ps(y + 3 * N, acc3);
}

/* Column blocks [c0, c1) for every row quad (w4a8.c's `columns`, 64 rows a pass; with VNNI:
 * vnni.h's tiles, the same result); `hs`: dw is the fp16 dm above (mw unread). */
static inline __attribute__((always_inline)) void nib_columns(const int8_t *xq, const float *dx, const float *sx,
                                                              const uint8_t *wn, const float *dw, const float *mw,
                                                              float *y, int64_t M, int64_t N, int64_t K, int64_t c0,
                                                              int64_t c1, const int hs) {
#ifdef PDSERVE_VNNI
    w4a8_columns_vnni(xq, dx, sx, wn, dw, mw, y, M, N, K, c0, c1, 16, 1, hs);
    return;
#endif
    const int64_t G = K / 32, quads = (M + 3) / 4;
    for (int64_t r0 = 0; r0 < quads; r0 += 16) {
        const int64_t r1 = r0 + 16 < quads ? r0 + 16 : quads;
        for (int64_t c = c0; c < c1; c++)
            for (int64_t r = r0; r < r1; r++) {
                const int rows = M - 4 * r < 4 ? (int)(M - 4 * r) : 4;
                const int8_t *xr = xq + r * 4 * K;
                const float *dr = dx + r * 8 * G, *sr = sx + r * 4 * G;
                if (rows == 1)
                    tile_nib(xr, dr, sr, K, wn + c * K * 4, dw + c * G * 8, mw + c * G * 8, y + 4 * r * N + c * 8, N, 1, 1, hs);
                else
                    tile_nib(xr, dr, sr, K, wn + c * K * 4, dw + c * G * 8, mw + c * G * 8, y + 4 * r * N + c * 8, N, rows, 4, hs);
            }
    }
}

void w4a8n_columns(const int8_t *xq, const float *dx, const float *sx, const uint8_t *wn, const float *dw,
                   const float *mw, float *y, int64_t M, int64_t N, int64_t K, int64_t c0, int64_t c1) {
    nib_columns(xq, dx, sx, wn, dw, mw, y, M, N, K, c0, c1, 0);
}

#ifdef W4A8_HALF_SCALES
void w4a8n_columns_h(const int8_t *xq, const float *dx, const float *sx, const uint8_t *wn, const float *dw,
                     const float *mw, float *y, int64_t M, int64_t N, int64_t K, int64_t c0, int64_t c1) {
    nib_columns(xq, dx, sx, wn, dw, mw, y, M, N, K, c0, c1, 1);
}
#endif
#endif

/* 1 where this build reads fp16 scales (w4a8n_matmul's `hs`), else 0. */
int w4a8n_half_scales(void) {
#if defined(__AVX2__) && defined(W4A8_HALF_SCALES)
    return 1;
#else
    return 0;
#endif
}

/* w4a8_matmul with nibble-packed weights wn (above); same arguments otherwise, same result;
 * `hs`: dw is the fp16 dm above (mw unread). Returns -1 without AVX2 (or F16C for `hs`). */
int w4a8n_matmul(const float *x, const uint8_t *wn, const float *dw, const float *mw, float *y, int64_t M, int64_t N,
                 int64_t K, int nt, int hs) {
#ifdef __AVX2__
#ifdef W4A8_HALF_SCALES
    if (hs) return w4a8_drive(x, wn, dw, mw, y, M, N, K, nt, w4a8n_columns_h);
#endif
    return hs ? -1 : w4a8_drive(x, wn, dw, mw, y, M, N, K, nt, w4a8n_columns);
#else
    (void)x; (void)wn; (void)dw; (void)mw; (void)y; (void)M; (void)N; (void)K; (void)nt; (void)hs;
    return -1;
#endif
}
