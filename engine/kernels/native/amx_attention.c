/* amx_attention.c - prompt rows' attention on AMX tiles (bf16 products, fp32 sums)
 *
 * Where "auto" runs prompt rows in bf16 (amx.c), their attention runs here too: a prompt of L
 * tokens does ~L^2 / 2 query-key products per head and layer, which the fp32 kernel
 * (attention_rows.c) computes at ~50 G multiply-adds/s on this kind of CPU.
 * Rows form runs as there (consecutive positions of one sequence, the same blocks), up to
 * AROWS rows a work item per KV head. An item packs its keys and values to bf16 tiles once,
 * its queries (times the 1/sqrt(D) scale, then rounded to bf16) as the tiles' rows, computes
 * the scores (query x key, D = 64 summed in the tiles), each row's softmax in fp32
 * (attend.h's, over its own keys), the numerators rounded to bf16, and their products with the
 * values summed over keys in ascending blocks of 32: each query's result depends only on its
 * own row, whatever the run, the chunking of the prompt or the thread count. Keys past a
 * row's length weigh exactly zero; key slots past the run's last key are zeros, not read.
 * Caches: fp32 or bf16 (bf16 keys and values are exact here), head dim 64, no window.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "attend.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>

#define AROWS 16 /* rows of one run per work item */
enum { HD = 64 };

void amx_configure_tiles(void); /* amx.c: every tile 16 rows x 64 bytes */
int amx_bf16_available(void);

static inline __m256i bf16x16(const float *f) { return (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(f)); }

/* One cached K or V row (HD values) as bf16. */
static inline void cache_row(const char *src, int fmt, uint16_t *dst) {
    if (fmt == KV_BF16) {
        memcpy(dst, src, HD * 2);
        return;
    }
    for (int i = 0; i < HD; i += 16) _mm256_storeu_si256((__m256i *)(dst + i), bf16x16((const float *)src + i));
}

/* Keys [32 c, 32 c + 32) of a segment (keys >= L zeros) into its tile layouts:
 *   kt (Lp/16, 2, 16, 16) 32-bit pairs: key chunk c16, half h of D, row r, key j = K[16 c16 + j][32 h + 2 r, + 1]
 *   vt (Lp/32, 4, 16, 16) 32-bit pairs: key pair chunk c, quarter u of D, row r, dim j = V[32 c + 2 r, + 1][16 u + j] */
static void pack_chunk(const char *kc, const char *vc, const int64_t *table, int64_t L, int64_t c, int kh, int KVH,
                       int bs, int fmt, uint32_t *kt, uint32_t *vt) {
    const size_t hrow = head_row_bytes(fmt, HD);
    uint16_t rows[2][2][HD]; /* (K, V) x the pair's two keys */
    for (int r = 0; r < 16; r++) {
        for (int e = 0; e < 2; e++) {
            const int64_t key = 32 * c + 2 * r + e;
            if (key >= L) {
                memset(rows[0][e], 0, sizeof rows[0][e]);
                memset(rows[1][e], 0, sizeof rows[1][e]);
                continue;
            }
            const size_t off = (((size_t)table[key / bs] * bs + key % bs) * KVH + kh) * hrow;
            cache_row(kc + off, fmt, rows[0][e]);
            cache_row(vc + off, fmt, rows[1][e]);
        }
        for (int e = 0; e < 2; e++) { /* key 2r + e is key j = (2r + e) % 16 of chunk 2c + (2r + e) / 16 */
            const int key = 2 * r + e, c16 = key / 16, j = key % 16;
            const uint32_t *k32 = (const uint32_t *)rows[0][e];
            for (int u = 0; u < 32; u++) kt[(((2 * c + c16) * 2 + u / 16) * 16 + u % 16) * 16 + j] = k32[u];
        }
        for (int h = 0; h < 2; h++) { /* interleave the two keys' values: dims 32 h .. 32 h + 31 */
            const __m512i a = _mm512_loadu_si512((const void *)(rows[1][0] + 32 * h));
            const __m512i b = _mm512_loadu_si512((const void *)(rows[1][1] + 32 * h));
            /* unpack works per 128-bit lane: lane l holds dims 8l..8l+3 (lo) and 8l+4..8l+7 (hi) */
            const __m512i lo = _mm512_unpacklo_epi16(a, b), hi = _mm512_unpackhi_epi16(a, b);
            const __m512i i0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
            const __m512i i1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
            _mm512_storeu_si512((void *)(vt + ((c * 4 + 2 * h) * 16 + r) * 16), _mm512_permutex2var_epi32(lo, i0, hi));
            _mm512_storeu_si512((void *)(vt + ((c * 4 + 2 * h + 1) * 16 + r) * 16), _mm512_permutex2var_epi32(lo, i1, hi));
        }
    }
}

/* Rows [0, R) of a run x KV head kh, over its segment's packed keys and values (kt, vt as
 * uint16). Returns -1 without memory. */
static int amx_run(const float *q, const uint16_t *kt, const uint16_t *vt, const int64_t *lens, float *out, int R,
                   int H, int KVH, int kh, float scale) {
    const int G = H / KVH, M = R * G, Mp = (M + 15) & ~15;
    const int64_t Lp = (lens[R - 1] + 31) & ~(int64_t)31;
    char *mem = aligned_alloc(64, (size_t)Mp * HD * 2 + (size_t)Mp * Lp * 6 + 16 * HD * 4);
    if (!mem) return -1;
    uint16_t *qs = (uint16_t *)mem, *p = qs + (size_t)Mp * HD;
    float *scores = (float *)(p + (size_t)Mp * Lp), *acc = scores + (size_t)Mp * Lp, sums[AROWS * 16];
    memset(qs, 0, (size_t)Mp * HD * 2);
    for (int i = 0; i < M; i++) {
        const float *src = q + ((size_t)(i / G) * H + (size_t)kh * G + i % G) * HD;
        const __m512 sc = _mm512_set1_ps(scale);
        for (int d = 0; d < HD; d += 16)
            _mm256_storeu_si256((__m256i *)(qs + (size_t)i * HD + d),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(src + d), sc)));
    }
    amx_configure_tiles();
    for (int t = 0; t < Mp / 16; t++) {
        const int last = (t * 16 + 15 < M ? t * 16 + 15 : M - 1) / G; /* the tile's longest row */
        _tile_loadd(4, qs + (size_t)t * 16 * HD, HD * 2);
        _tile_loadd(5, qs + (size_t)t * 16 * HD + 32, HD * 2);
        for (int64_t c = 0; c * 16 < lens[last]; c++) {
            _tile_zero(0);
            _tile_loadd(6, kt + (size_t)c * 2 * 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(7, kt + ((size_t)c * 2 + 1) * 512, 64);
            _tile_dpbf16ps(0, 5, 7);
            _tile_stored(0, scores + (size_t)t * 16 * Lp + c * 16, Lp * 4);
        }
    }
    for (int i = 0; i < Mp; i++) { /* numerators in place, zeros past the row's keys, then bf16 */
        const int64_t len = i < M ? lens[i / G] : 0;
        float *s = scores + (size_t)i * Lp;
        if (len) sums[i] = softmax_numerators(s, len);
        memset(s + len, 0, (size_t)(Lp - len) * 4);
        for (int64_t j = 0; j < Lp; j += 16) _mm256_storeu_si256((__m256i *)(p + (size_t)i * Lp + j), bf16x16(s + j));
    }
    for (int t = 0; t < Mp / 16; t++) {
        const int last = (t * 16 + 15 < M ? t * 16 + 15 : M - 1) / G;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t c = 0; c * 32 < lens[last]; c++) { /* keys in ascending pairs of blocks of 16 */
            _tile_loadd(4, p + (size_t)t * 16 * Lp + c * 32, Lp * 2);
            _tile_loadd(5, vt + ((size_t)c * 4 + 0) * 512, 64);
            _tile_dpbf16ps(0, 4, 5);
            _tile_loadd(6, vt + ((size_t)c * 4 + 1) * 512, 64);
            _tile_dpbf16ps(1, 4, 6);
            _tile_loadd(7, vt + ((size_t)c * 4 + 2) * 512, 64);
            _tile_dpbf16ps(2, 4, 7);
            _tile_loadd(5, vt + ((size_t)c * 4 + 3) * 512, 64);
            _tile_dpbf16ps(3, 4, 5);
        }
        _tile_stored(0, acc, HD * 4); /* the tile number is an immediate */
        _tile_stored(1, acc + 16, HD * 4);
        _tile_stored(2, acc + 32, HD * 4);
        _tile_stored(3, acc + 48, HD * 4);
        for (int r = 0; r < 16 && t * 16 + r < M; r++) {
            const int i = t * 16 + r;
            float *o = out + ((size_t)(i / G) * H + (size_t)kh * G + i % G) * HD;
            const __m512 inv = _mm512_set1_ps(1.f / sums[i]);
            for (int d = 0; d < HD; d += 16) _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_loadu_ps(acc + r * HD + d), inv));
        }
    }
    _tile_release(); /* amx.c: amx_configure_tiles */
    free(mem);
    return 0;
}

/* Whether row i + 1 continues row i's run: the next position over the same blocks. */
static int continues(const int64_t *tables, const int64_t *lens, int i, int bs, int max_blocks) {
    if (lens[i + 1] != lens[i] + 1) return 0;
    const int64_t nblk = (lens[i + 1] + bs - 1) / bs;
    return memcmp(tables + (size_t)i * max_blocks, tables + (size_t)(i + 1) * max_blocks,
                  sizeof(int64_t) * (size_t)nblk) == 0;
}

/* q (B, H, 64) fp32 prompt rows; caches and tables as paged_decode_attention_f32 takes them
 * (fmt KV_F32 or KV_BF16); out (B, H, 64). Segments (maximal runs) pack their keys and values
 * once per KV head, in parallel over chunks of 32 keys; then runs of up to AROWS rows attend.
 * 0 done, -1 no memory, -2 not this kernel's case. */
int amx_prompt_attention(const float *q, const void *kc, const void *vc, const int64_t *tables, const int64_t *lens,
                         float *out, int B, int H, int KVH, int D, int bs, int max_blocks, float scale, int nthreads,
                         int fmt) {
    if (D != HD || (fmt != KV_F32 && fmt != KV_BF16) || H % KVH || H / KVH > 16 || !amx_bf16_available()) return -2;
    int *seg = malloc(sizeof(int) * ((size_t)B + 1) * 3), ns = 0, nr = 0, failed = 0;
    if (!seg) return -1;
    int *run = seg + B + 1, *chunk0 = run + B + 1; /* runs' first rows; each segment's first chunk in `packs` */
    for (int r = 0; r < B; r++) {
        if (r == 0 || !continues(tables, lens, r - 1, bs, max_blocks)) seg[ns++] = r;
        if (r == seg[ns - 1] || r - run[nr - 1] >= AROWS) run[nr++] = r;
    }
    seg[ns] = run[nr] = B;
    int64_t chunks = 0; /* 32-key chunks over all segments */
    for (int s = 0; s < ns; s++) {
        chunk0[s] = (int)chunks;
        chunks += (lens[seg[s + 1] - 1] + 31) / 32;
    }
    /* per KV head: every chunk's keys (1,024 32-bit pairs a chunk), then every chunk's values */
    uint32_t *packs = aligned_alloc(64, (size_t)chunks * KVH * 2048 * 4 + 64);
    if (!packs) {
        free(seg);
        return -1;
    }
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
#pragma omp for schedule(static)
        for (int64_t w = 0; w < chunks * KVH; w++) {
            const int64_t c = w / KVH;
            const int kh = (int)(w % KVH);
            int s = 0;
            while (s + 1 < ns && chunk0[s + 1] <= c) s++;
            uint32_t *base = packs + (size_t)kh * chunks * 2048;
            pack_chunk((const char *)kc, (const char *)vc, tables + (size_t)seg[s] * max_blocks, lens[seg[s + 1] - 1],
                       c - chunk0[s], kh, KVH, bs, fmt, base + (size_t)chunk0[s] * 1024,
                       base + (size_t)(chunks + chunk0[s]) * 1024);
        }
#pragma omp for schedule(dynamic, 1)
        for (int w = 0; w < nr * KVH; w++) {
            const int r0 = run[w / KVH], kh = w % KVH;
            int s = 0;
            while (s + 1 < ns && seg[s + 1] <= r0) s++;
            const uint32_t *base = packs + (size_t)kh * chunks * 2048;
            const size_t off = (size_t)r0 * H * HD;
            failed |= amx_run(q + off, (const uint16_t *)(base + (size_t)chunk0[s] * 1024),
                              (const uint16_t *)(base + (size_t)(chunks + chunk0[s]) * 1024), lens + r0, out + off,
                              run[w / KVH + 1] - r0, H, KVH, kh, scale) != 0;
        }
    }
    free(packs);
    free(seg);
    return failed ? -1 : 0;
}

#else
int amx_prompt_attention(const float *q, const void *kc, const void *vc, const int64_t *tables, const int64_t *lens,
                         float *out, int B, int H, int KVH, int D, int bs, int max_blocks, float scale, int nthreads,
                         int fmt) {
    (void)q, (void)kc, (void)vc, (void)tables, (void)lens, (void)out, (void)B, (void)H, (void)KVH, (void)D;
    (void)bs, (void)max_blocks, (void)scale, (void)nthreads, (void)fmt;
    return -2;
}
#endif
