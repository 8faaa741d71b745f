/* amx_attention.c - prompt rows' attention on AMX tiles (bf16 products, fp32 sums)
 *
 * Where "auto" runs prompt rows in bf16 (amx.c), their attention runs here too: a prompt of L
 * tokens does ~L^2 / 2 query-key products per head and layer, which the fp32 kernel
 * (attention_rows.c) computes at ~50 G multiply-adds/s on this kind of CPU. The flash-style
 * kernel is flash.h's; here are its two block products on tiles: a tile of 16 query rows' scores
 * against KB keys (D = 64 summed in the tiles) and its numerators' products with the values,
 * added to the rows' sums in the tiles. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "attend.h"
#include "flash.h"

#if defined(PDSERVE_FLASH) && defined(__AMX_TILE__) && defined(__AMX_BF16__)

void amx_configure_tiles(void); /* amx.c: every tile 16 rows x 64 bytes */
int amx_bf16_available(void);

/* The tile's scores against keys [k0, k0 + KB) into f->s: Q in tiles 4-5, keys in 6-7. */
static inline void block_scores(const uint16_t *qs, const uint16_t *kt, int64_t k0, flash_state *f) {
    const uint16_t *k = kt + (size_t)(k0 / 16) * 2 * 512;
    _tile_loadd(4, qs, HD * 2);
    _tile_loadd(5, qs + 32, HD * 2);
#define SCORES(T)                                                                                                      \
    _tile_zero(T);                                                                                                     \
    _tile_loadd(6, k + (T) * 1024, 64);                                                                                \
    _tile_dpbf16ps(T, 4, 6);                                                                                           \
    _tile_loadd(7, k + (T) * 1024 + 512, 64);                                                                          \
    _tile_dpbf16ps(T, 5, 7);
    SCORES(0) SCORES(1) SCORES(2) SCORES(3)
#undef SCORES
    _tile_stored(0, f->s[0], KB * 4);
    _tile_stored(1, f->s[0] + 16, KB * 4);
    _tile_stored(2, f->s[0] + 32, KB * 4);
    _tile_stored(3, f->s[0] + 48, KB * 4);
}

/* f->acc plus the block's numerators (f->p) times values [k0, k0 + KB): P in tile 4, values in 5-7. */
static inline void block_values(const uint16_t *vt, int64_t k0, flash_state *f) {
    _tile_loadd(0, f->acc[0], HD * 4);
    _tile_loadd(1, f->acc[0] + 16, HD * 4);
    _tile_loadd(2, f->acc[0] + 32, HD * 4);
    _tile_loadd(3, f->acc[0] + 48, HD * 4);
    for (int h = 0; h < 2; h++) {
        const uint16_t *v = vt + (size_t)(k0 / 32 + h) * 4 * 512;
        _tile_loadd(4, f->p[0] + 32 * h, KB * 2);
        _tile_loadd(5, v, 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, v + 512, 64);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(7, v + 1024, 64);
        _tile_dpbf16ps(2, 4, 7);
        _tile_loadd(5, v + 1536, 64);
        _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, f->acc[0], HD * 4); /* the tile number is an immediate */
    _tile_stored(1, f->acc[0] + 16, HD * 4);
    _tile_stored(2, f->acc[0] + 32, HD * 4);
    _tile_stored(3, f->acc[0] + 48, HD * 4);
}

static void release_tiles(void) { _tile_release(); } /* amx.c: amx_configure_tiles */

static int amx_run(const float *q, const uint16_t *kt, const uint16_t *vt, const int64_t *lens, float *out, int R,
                   int H, int KVH, int kh, float scale) {
    return flash_run(q, kt, vt, lens, out, R, H, KVH, kh, scale, block_scores, block_values, amx_configure_tiles,
                     release_tiles, 0);
}

/* q (B, H, 64) fp32 prompt rows; caches and tables as paged_decode_attention_f32 takes them
 * (fmt KV_F32 or KV_BF16); out (B, H, 64). 0 done, -1 no memory, -2 not this kernel's case. */
int amx_prompt_attention(const float *q, const void *kc, const void *vc, const int64_t *tables, const int64_t *lens,
                         float *out, int B, int H, int KVH, int D, int bs, int max_blocks, float scale, int nthreads,
                         int fmt) {
    if (!amx_bf16_available()) return -2;
    return flash_prompt_attention(q, kc, vc, tables, lens, out, B, H, KVH, D, bs, max_blocks, scale, nthreads, fmt,
                                  amx_run);
}

#else
FLASH_ABSENT(amx_prompt_attention)
#endif
