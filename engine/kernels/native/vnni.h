/* vnni.h - the VNNI forms of the integer kernels, built where the compiler targets AVX-512
 * VNNI (with VL) or AVX-VNNI (engine/kernels/native/__init__.py `isa` picks the flags per CPU).
 *
 * vpdpbusd adds the 4 products of unsigned and signed bytes straight into int32 lanes (w4a8.c,
 * w4a8n.c: one instruction where AVX2 needs vpmaddubsw and vpaddw per k-quad and vpmaddwd per
 * half group); vpdpwssd the 2 products of int16 pairs (q8a16.c: vpmaddwd and vpaddd). The
 * integer sums are the same numbers, and every fp32 operation is the AVX2 path's in its order,
 * so each kernel's result is bitwise its AVX2 result.
 * The W4A8 tile below takes up to 8 rows (two row quads) per weight vector, unpacked once:
 * with AVX-512's 32 registers their accumulators stay in registers; the AVX2 tile takes 4.
 * Built for AVX-512 (F, BW, DQ, VNNI), the tiles span two column blocks (16 columns) in 512-bit
 * vectors, the same lane arithmetic: 1.9x the 256-bit tiles' multiply-adds per second on a
 * 2-core Zen 5 EPYC (284 against 147 GMAC/s on one core, the default model's four matrices at
 * 32 rows), where 512-bit operations run at the 256-bit ones' rate.
 */
#ifndef PDSERVE_VNNI_H
#define PDSERVE_VNNI_H
#include <immintrin.h>
#include <stdint.h>

/* Where a build reads a matrix's scales in fp16 (`hs`: w4a8n.c's nibble weights, when the
 * model's scales and minima are all fp16 values, as a GGUF's Q4_1 stores them): a group's 8
 * scales then its 8 minima, 32 bytes at the fp32 layout's d + 8 g (a column block's groups at
 * the same stride as its fp32 scales), widened exactly; otherwise d and m are fp32, apart. */
#if defined(__F16C__) || defined(__AVX512F__)
#define W4A8_HALF_SCALES 1
#endif
static inline __attribute__((always_inline)) void w4a8_scales(const float *dw, const float *mw, int64_t g,
                                                              const int hs, __m256 *dv, __m256 *mv) {
#ifdef W4A8_HALF_SCALES
    if (hs) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)(dw + g * 8));
        *dv = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
        *mv = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
        return;
    }
#endif
    (void)hs;
    *dv = _mm256_loadu_ps(dw + g * 8);
    *mv = _mm256_loadu_ps(mw + g * 8);
}

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define PDSERVE_VNNI 1
#define W4A8_DPBUSD(acc, w, x) _mm256_dpbusd_epi32((acc), (w), (x))
#define Q8A16_DPWSSD(acc, w, x) _mm256_dpwssd_epi32((acc), (w), (x))
#elif defined(__AVXVNNI__)
#define PDSERVE_VNNI 1
#define W4A8_DPBUSD(acc, w, x) _mm256_dpbusd_avx_epi32((acc), (w), (x))
#define Q8A16_DPWSSD(acc, w, x) _mm256_dpwssd_avx_epi32((acc), (w), (x))
#endif

#ifdef PDSERVE_VNNI
/* Rows 0..R-1 (R = 1, 4 or 8; `rows` of them stored) of the row quads starting at xq (quads
 * 4K bytes apart, w4a8.c's quantized layout) x one column block of 8 columns at w: its 4-bit
 * weights one a byte (`nib` 0, w4a8.c's layout) or two a byte (`nib` 1, w4a8n.c's). */
static inline __attribute__((always_inline)) void w4a8_tile_vnni(const int8_t *xq, const float *dx, const float *sx,
                                                                 int64_t K, const uint8_t *w, const float *dw,
                                                                 const float *mw, float *y, int64_t N, int rows,
                                                                 const int R, const int nib, const int hs) {
    const int64_t G = K / 32;
    const __m256i low = _mm256_set1_epi8(15);
    __m256 acc[8];
    for (int i = 0; i < R; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m256 dv, mv;
        w4a8_scales(dw, mw, g, hs, &dv, &mv);
        for (int h = 0; h < 2; h++) {
            __m256i wv[4];
            if (nib) {
                const uint8_t *wp = w + g * 128 + h * 64;
                const __m256i v0 = _mm256_loadu_si256((const __m256i *)wp);
                const __m256i v1 = _mm256_loadu_si256((const __m256i *)(wp + 32));
                wv[0] = _mm256_and_si256(v0, low);
                wv[1] = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low);
                wv[2] = _mm256_and_si256(v1, low);
                wv[3] = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low);
            } else {
                for (int t = 0; t < 4; t++) wv[t] = _mm256_loadu_si256((const __m256i *)(w + g * 256 + h * 128 + t * 32));
            }
            const int8_t *xp = xq + g * 128 + h * 64;
            __m256i a[8];
            for (int i = 0; i < R; i++) a[i] = _mm256_setzero_si256();
            for (int t = 0; t < 4; t++)
                for (int i = 0; i < R; i++)
                    a[i] = W4A8_DPBUSD(a[i], wv[t],
                                       _mm256_set1_epi32(*(const int32_t *)(xp + (i >> 2) * 4 * K + t * 16 + (i & 3) * 4)));
            for (int i = 0; i < R; i++) {
                const __m256 s = _mm256_mul_ps(dv, _mm256_broadcast_ss(dx + (i >> 2) * 8 * G + g * 8 + h * 4 + (i & 3)));
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[i]), s, acc[i]);
            }
        }
        for (int i = 0; i < R; i++)
            acc[i] = _mm256_fmadd_ps(mv, _mm256_broadcast_ss(sx + (i >> 2) * 4 * G + g * 4 + (i & 3)), acc[i]);
    }
    for (int i = 0; i < R && i < rows; i++) _mm256_storeu_ps(y + i * N, acc[i]);
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define PDSERVE_VNNI512 1
/* Up to this many rows a matmul over nibble-packed weights (a decode step's) takes the 256-bit
 * tiles all the same (cpu.py `narrow_rows`: 8 on a Zen 4, which runs a 512-bit operation as two
 * 256-bit halves; 0 elsewhere). Byte weights keep the 512-bit tiles at every row count. */
#ifndef PDSERVE_NARROW_ROWS
#define PDSERVE_NARROW_ROWS 0
#endif
/* 32 bytes at lo and 32 at hi as one 512-bit vector (two column blocks' weights side by side). */
static inline __attribute__((always_inline)) __m512i w4a8_join(const uint8_t *lo, const uint8_t *hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)lo)),
                              _mm256_loadu_si256((const __m256i *)hi), 1);
}
/* 8 floats at lo and 8 at hi as one vector (two column blocks' scales or minima). */
static inline __attribute__((always_inline)) __m512 w4a8_joinf(const float *lo, const float *hi) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(lo)), _mm256_loadu_ps(hi), 1);
}

/* w4a8_tile_vnni over two adjacent column blocks at once (16 columns, one 512-bit vector):
 * block c's weights at w, block c + 1's `cs` bytes further, their scales and minima G * 8
 * floats apart. Every lane's arithmetic is the 256-bit tile's, so the result is bitwise its. */
static inline __attribute__((always_inline)) void w4a8_tile_vnni512(const int8_t *xq, const float *dx,
                                                                    const float *sx, int64_t K, const uint8_t *w,
                                                                    int64_t cs, const float *dw, const float *mw,
                                                                    float *y, int64_t N, int rows, const int R,
                                                                    const int nib, const int hs) {
    const int64_t G = K / 32;
    const __m512i low = _mm512_set1_epi8(15);
    __m512 acc[8];
    for (int i = 0; i < R; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m512 dv, mv;
        if (hs) { /* w4a8_scales' fp16 form: block c's 16 at dw + 8 g, block c + 1's G * 8 floats on */
            const __m256i lo = _mm256_loadu_si256((const __m256i *)(dw + g * 8));
            const __m256i hi = _mm256_loadu_si256((const __m256i *)(dw + G * 8 + g * 8));
            dv = _mm512_cvtph_ps(_mm256_permute2x128_si256(lo, hi, 0x20));
            mv = _mm512_cvtph_ps(_mm256_permute2x128_si256(lo, hi, 0x31));
        } else {
            dv = w4a8_joinf(dw + g * 8, dw + G * 8 + g * 8);
            mv = w4a8_joinf(mw + g * 8, mw + G * 8 + g * 8);
        }
        for (int h = 0; h < 2; h++) {
            __m512i wv[4];
            if (nib) {
                const uint8_t *wp = w + g * 128 + h * 64;
                const __m512i v0 = w4a8_join(wp, wp + cs), v1 = w4a8_join(wp + 32, wp + cs + 32);
                wv[0] = _mm512_and_si512(v0, low);
                wv[1] = _mm512_and_si512(_mm512_srli_epi16(v0, 4), low);
                wv[2] = _mm512_and_si512(v1, low);
                wv[3] = _mm512_and_si512(_mm512_srli_epi16(v1, 4), low);
            } else {
                for (int t = 0; t < 4; t++) {
                    const uint8_t *wp = w + g * 256 + h * 128 + t * 32;
                    wv[t] = w4a8_join(wp, wp + cs);
                }
            }
            const int8_t *xp = xq + g * 128 + h * 64;
            __m512i a[8];
            for (int i = 0; i < R; i++) a[i] = _mm512_setzero_si512();
            for (int t = 0; t < 4; t++)
                for (int i = 0; i < R; i++)
                    a[i] = _mm512_dpbusd_epi32(a[i], wv[t],
                                               _mm512_set1_epi32(*(const int32_t *)(xp + (i >> 2) * 4 * K + t * 16 + (i & 3) * 4)));
            for (int i = 0; i < R; i++) {
                const __m512 s = _mm512_mul_ps(dv, _mm512_set1_ps(dx[(i >> 2) * 8 * G + g * 8 + h * 4 + (i & 3)]));
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[i]), s, acc[i]);
            }
        }
        for (int i = 0; i < R; i++)
            acc[i] = _mm512_fmadd_ps(mv, _mm512_set1_ps(sx[(i >> 2) * 4 * G + g * 4 + (i & 3)]), acc[i]);
    }
    for (int i = 0; i < R && i < rows; i++) _mm512_storeu_ps(y + i * N, acc[i]);
}
#endif

/* Column blocks [c0, c1) for every row of the quantized x, two quads a tile (two column
 * blocks a tile where built for AVX-512; for nibble weights above PDSERVE_NARROW_ROWS rows), `rc` quads a
 * pass over the columns (their int8 copy stays in L2; rc even); `hs`: fp16 scales (w4a8_scales). */
static inline __attribute__((always_inline)) void w4a8_columns_vnni(const int8_t *xq, const float *dx,
                                                                    const float *sx, const uint8_t *w,
                                                                    const float *dw, const float *mw, float *y,
                                                                    int64_t M, int64_t N, int64_t K, int64_t c0,
                                                                    int64_t c1, int64_t rc, const int nib,
                                                                    const int hs) {
    const int64_t G = K / 32, quads = (M + 3) / 4, cstride = nib ? K * 4 : K * 8;
    for (int64_t r0 = 0; r0 < quads; r0 += rc) {
        const int64_t r1 = r0 + rc < quads ? r0 + rc : quads;
        int64_t c = c0;
#ifdef PDSERVE_VNNI512
        for (; (!nib || M > PDSERVE_NARROW_ROWS) && c + 1 < c1; c += 2)
            for (int64_t r = r0; r < r1; r += 2) {
                const int rows = M - 4 * r < 8 ? (int)(M - 4 * r) : 8;
                const int8_t *xr = xq + r * 4 * K;
                const float *dr = dx + r * 8 * G, *sr = sx + r * 4 * G, *dc = dw + c * G * 8, *mc = mw + c * G * 8;
                float *yr = y + 4 * r * N + c * 8;
                if (rows > 4)
                    w4a8_tile_vnni512(xr, dr, sr, K, w + c * cstride, cstride, dc, mc, yr, N, rows, 8, nib, hs);
                else if (rows > 1)
                    w4a8_tile_vnni512(xr, dr, sr, K, w + c * cstride, cstride, dc, mc, yr, N, rows < 4 ? rows : 4, 4, nib, hs);
                else
                    w4a8_tile_vnni512(xr, dr, sr, K, w + c * cstride, cstride, dc, mc, yr, N, 1, 1, nib, hs);
            }
#endif
        for (; c < c1; c++)
            for (int64_t r = r0; r < r1; r += 2) {
                const int rows = M - 4 * r < 8 ? (int)(M - 4 * r) : 8;
                const int8_t *xr = xq + r * 4 * K;
                const float *dr = dx + r * 8 * G, *sr = sx + r * 4 * G, *dc = dw + c * G * 8, *mc = mw + c * G * 8;
                float *yr = y + 4 * r * N + c * 8;
                if (rows > 4) /* quad r + 1 is in this pass: rc is even */
                    w4a8_tile_vnni(xr, dr, sr, K, w + c * cstride, dc, mc, yr, N, rows, 8, nib, hs);
                else if (rows > 1)
                    w4a8_tile_vnni(xr, dr, sr, K, w + c * cstride, dc, mc, yr, N, rows < 4 ? rows : 4, 4, nib, hs);
                else
                    w4a8_tile_vnni(xr, dr, sr, K, w + c * cstride, dc, mc, yr, N, 1, 1, nib, hs);
            }
    }
}
#endif /* PDSERVE_VNNI */
#endif /* PDSERVE_VNNI_H */
