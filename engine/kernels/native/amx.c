/* amx.c - bf16 matmul on AMX tiles: y = bf16(x) @ W.T with fp32 sums, for prompt rows
 *
 * A prompt chunk is bound by arithmetic. On a CPU with AMX one tile multiply (tdpbf16ps) does
 * 16 x 16 x 32 bf16 multiply-adds into fp32: measured 2-3x the rate of the 512-bit VNNI
 * W4A8 kernel (w4a8.c) at 128-512 rows. The weights are the checkpoint's values rounded to
 * bf16 (a Q4_1 grid value has 4 bits of level and the group's fp16 scale, so rounding moves
 * it by at most 2^-9 of itself), the activations are rounded to bf16 (round to nearest
 * even), the products and sums are fp32 in the tiles.
 *
 * Weight layout (engine/kernels/native/amx.py `pack`), for N % 32 == 0 and K % 32 == 0:
 *   w bf16 (N/16, K/32, 16, 16, 2): column block c, k block b, row r holds k = 32b + 2r and
 *   32b + 2r + 1 for the block's 16 columns: one 1 KB tile, the B operand as tdpbf16ps takes it.
 * Each thread takes blocks of 32 output columns and runs every 32 rows of x against them:
 * 2 x 2 tiles of sums, over k in the same order whatever M and the thread count, so a row's
 * result depends only on that row (batch invariant).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <unistd.h>
#include <sys/syscall.h>

#define ARCH_REQ_XCOMP_PERM 0x1023 /* Linux: ask for an extended state component */
#define XFEATURE_XTILEDATA 18

/* Linux hands out AMX's 8 KB of tile state only to a process that asks once. */
static int amx_permitted(void) {
    static int state = 0; /* 0 unknown, 1 yes, -1 no */
    if (state == 0) state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    return state == 1;
}

int amx_bf16_available(void) { return amx_permitted(); }

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Per thread: every tile 16 rows x 64 bytes (here: 0-3 sums (16 x 16 fp32), 4-5 rows of x, 6-7
 * weight blocks; amx_attention.c uses the same shapes). Each use ends with _tile_release, which
 * returns the thread's tiles to their initial state: Linux then saves and restores none of their
 * 8 KB when it switches the thread out (torch's OpenMP threads run everything else too). */
void amx_configure_tiles(void) {
    /* a constant, not a struct filled in here: GCC dropped the stores to a local one as dead
     * (it does not see ldtilecfg read them), and the tiles were left unconfigured */
    static const tile_config config = {.palette = 1,
                                       .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
                                       .rows = {16, 16, 16, 16, 16, 16, 16, 16}};
    _tile_loadconfig(&config);
}

/* x fp32 rows [0, m) -> bf16 in the tiles' order, (mp/16, k/32, 16, 32): each tile's 16 rows of
 * 32 values one contiguous KB, so a tile load reads 16 consecutive lines (with a row stride of
 * 2k bytes: 3-7% slower at 512 rows on one Xeon core); rows [m, mp) zero (the last tile's padding). */
static void to_bf16(const float *x, uint16_t *xb, int64_t m, int64_t mp, int64_t k) {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < mp; i++) {
        uint16_t *d = xb + (i / 16) * k * 16 + (i % 16) * 32;
        for (int64_t j = 0; j < k; j += 32, d += 512) {
            if (i >= m) {
                memset(d, 0, 64);
                continue;
            }
            /* the lower 16 values from the second operand */
            _mm512_storeu_si512((void *)d, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i * k + j + 16),
                                                                        _mm512_loadu_ps(x + i * k + j)));
        }
    }
}

/* Rows [r, r + 32) of y, columns [32 nb, 32 nb + 32): a 2 x 2 block of tiles over all of k.
 * A block past row m is stored to `tmp` and its valid rows copied. */
static void block(const uint16_t *xb, const uint16_t *w, float *y, int64_t r, int64_t nb, int64_t m, int64_t n,
                  int64_t k, float *tmp) {
    const int64_t kb = k / 32;
    const uint16_t *b0 = w + 2 * nb * kb * 512, *b1 = b0 + kb * 512, *a = xb + r * k; /* row tile r / 16 */
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t b = 0; b < kb; b++) {
        _tile_loadd(4, a + b * 512, 64);
        _tile_loadd(5, a + 16 * k + b * 512, 64);
        _tile_loadd(6, b0 + b * 512, 64);
        _tile_loadd(7, b1 + b * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    int whole = r + 32 <= m;
    float *o = whole ? y + r * n + nb * 32 : tmp;
    int64_t ld = whole ? n : 32;
    _tile_stored(0, o, ld * 4);
    _tile_stored(1, o + 16, ld * 4);
    _tile_stored(2, o + 16 * ld, ld * 4);
    _tile_stored(3, o + 16 * ld + 16, ld * 4);
    if (!whole)
        for (int64_t i = r; i < m; i++) memcpy(y + i * n + nb * 32, tmp + (i - r) * 32, 32 * 4);
}

/* y (m, n) fp32 = bf16(x (m, k) fp32) @ W.T, W in `pack`'s layout. 0 done, 1 no memory,
 * 2 shapes not multiples of 32, 3 no AMX permission. */
int amx_bf16_matmul(const float *x, const uint16_t *w, float *y, int64_t m, int64_t n, int64_t k, int threads) {
    if (n % 32 || k % 32) return 2;
    if (!amx_permitted()) return 3;
    if (m <= 0) return 0;
    int64_t mp = (m + 31) & ~(int64_t)31;
    uint16_t *xb = aligned_alloc(64, (size_t)(mp * k * 2));
    if (!xb) return 1;
#pragma omp parallel num_threads(threads)
    {
        float tmp[32 * 32];
        to_bf16(x, xb, m, mp, k);
        amx_configure_tiles(); /* tile state is per thread */
#pragma omp for schedule(static)
        for (int64_t nb = 0; nb < n / 32; nb++)
            for (int64_t r = 0; r < mp; r += 32) block(xb, w, y, r, nb, m, n, k, tmp);
        _tile_release(); /* see amx_configure_tiles */
    }
    free(xb);
    return 0;
}

#else
int amx_bf16_available(void) { return 0; }
int amx_bf16_matmul(const float *x, const uint16_t *w, float *y, int64_t m, int64_t n, int64_t k, int threads) {
    (void)x, (void)w, (void)y, (void)m, (void)n, (void)k, (void)threads;
    return 3;
}
#endif
