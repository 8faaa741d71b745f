/* flash.h - prompt rows' attention in bf16, flash style: what the AMX kernel (amx_attention.c)
 * and the AVX-512 BF16 one (bf16_attention.c) share. Each supplies the two products of a block,
 * a tile of 16 query rows x KB keys: its scores (Q K^T) and its values (P V); the rest is here.
 *
 * Rows form runs (consecutive positions of one sequence over the same blocks), up to AROWS rows a
 * work item per KV head. A segment's keys and values are packed to bf16 pairs once per KV head
 * (pack_chunk's layouts); an item's queries (times the 1/sqrt(D) scale, then rounded to bf16, or
 * with the rest in a second half: flash_run's `split`) are 16 to a tile, up to NT tiles at a time. Over blocks of KB keys from key 0 up: the block's
 * scores, each row's running max and fp32 sums updated by the block's own keys (exp of the
 * scores less the max; what the row summed before shrinks when its max grows), the numerators
 * rounded to bf16 and their products with the values added to the row's sums. Each query's
 * result depends only on its own row, whatever the run, the chunking of the prompt or the
 * thread count: the blocks start at key 0 whatever the row, and a row without keys in a block
 * keeps its state bit for bit. Keys past a row's length weigh exactly zero; key slots past the
 * segment's last key are zeros. Caches: fp32 or bf16 (bf16 keys and values are exact here),
 * head dim 64, no window. Built where the compiler targets AVX-512 BF16. */
#ifndef PDSERVE_FLASH_H
#define PDSERVE_FLASH_H
/* An entry point whose kernel this build lacks: it refuses every call (-2: not its case). */
#define FLASH_ABSENT(name)                                                                                   \
    int name(const float *q, const void *kc, const void *vc, const int64_t *tables, const int64_t *lens,     \
             float *out, int B, int H, int KVH, int D, int bs, int max_blocks, float scale, int nthreads,  \
             int fmt) {                                                                                      \
        (void)q, (void)kc, (void)vc, (void)tables, (void)lens, (void)out, (void)B, (void)H, (void)KVH;       \
        (void)D, (void)bs, (void)max_blocks, (void)scale, (void)nthreads, (void)fmt;                         \
        return -2;                                                                                           \
    }
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#include <float.h>
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "kvformat.h"
#define PDSERVE_FLASH 1

#define AROWS 16 /* rows of one run per work item */
#define KB 64    /* keys per block */
enum { HD = 64 };

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

/* exp(s - m), 16 lanes, for s <= m: 2^t with t = (s - m) log2(e) split into n = round(t) and
 * f = t - n in [-1/2, 1/2], 2^f by its degree-5 Taylor polynomial (relative error < 3e-6, below
 * the bf16 rounding every numerator gets), 2^n by vscalefps (0 once t is below -150). */
static inline __m512 exp_minus(__m512 s, __m512 m_log2e) {
    const __m512 t = _mm512_fmsub_ps(s, _mm512_set1_ps(1.44269504f), m_log2e);
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.3333558e-3f); /* ln2^k / k! */
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24022651f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69314718f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* Per query row of a tile: the running max, whether it has seen a key, its running sums (16
 * lanes, reduced at the end), its numerator-weighted values (the tiles add each block's to
 * them), and the block's scores and numerators. */
typedef struct {
    float m[16], sums[16][16], acc[16][HD], s[16][KB];
    uint16_t p[16][KB];
    __mmask16 seen; /* rows that have had keys */
} flash_state;

/* Row r's numerators over its keys in the block (n of them, 1..KB): p = exp(s - m) with the
 * row's new max m, as bf16; its earlier sums and values rescaled by exp(m_old - m) first. A
 * row without keys in the block gets p = 0 and keeps its state bit for bit. */
static inline void block_softmax(flash_state *f, int r, int64_t n) {
    if (n <= 0) {
        memset(f->p[r], 0, sizeof f->p[r]); /* weighs nothing, changes nothing */
        return;
    }
    __mmask16 k[4];
    __m512 s[4], mx = _mm512_set1_ps(-FLT_MAX);
    for (int c = 0; c < 4; c++) {
        const int64_t valid = n - 16 * c;
        k[c] = valid >= 16 ? 0xffff : valid <= 0 ? 0 : (__mmask16)((1u << valid) - 1);
        s[c] = _mm512_loadu_ps(f->s[r] + 16 * c);
        mx = _mm512_mask_max_ps(mx, k[c], mx, s[c]);
    }
    float m = _mm512_reduce_max_ps(mx);
    const int seen = f->seen >> r & 1;
    __m512 sum = seen ? _mm512_loadu_ps(f->sums[r]) : _mm512_setzero_ps();
    if (seen && f->m[r] >= m)
        m = f->m[r];
    else if (seen) { /* a larger max: what the row summed so far shrinks by exp(old - new) */
        const __m512 a = exp_minus(_mm512_set1_ps(f->m[r]), _mm512_set1_ps(m * 1.44269504f));
        sum = _mm512_mul_ps(sum, a);
        for (int d = 0; d < HD; d += 16) _mm512_storeu_ps(f->acc[r] + d, _mm512_mul_ps(_mm512_loadu_ps(f->acc[r] + d), a));
    }
    const __m512 mv = _mm512_set1_ps(m * 1.44269504f);
    for (int c = 0; c < 4; c += 2) {
        const __m512 e0 = _mm512_maskz_mov_ps(k[c], exp_minus(s[c], mv));
        const __m512 e1 = _mm512_maskz_mov_ps(k[c + 1], exp_minus(s[c + 1], mv));
        sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
        _mm512_storeu_si512((void *)(f->p[r] + 16 * c), (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
    }
    _mm512_storeu_ps(f->sums[r], sum);
    f->m[r] = m;
    f->seen |= (__mmask16)(1u << r);
}


/* A group of up to NT tiles of 16 query rows: their bf16 queries (already scaled), each row's
 * length (0: a padding row) and where its result goes (NULL: padding). */
#define NT 4
typedef struct {
    const uint16_t *qs[NT];
    int64_t len[NT][16];
    float *dst[NT][16];
    int n;
} tile_group;

/* The group's rows against their keys, flash style: blocks of KB keys from key 0 up, each row's
 * max, sums and values updated by its own keys only, so its result is the same whatever else
 * shares its tile or group. Each stage runs over the whole group before the next (all scores,
 * then all softmaxes, ...): a tile's stores have reached memory before vector code or a tile
 * load reads them (a load right behind them stalled the kernel). */
typedef void (*flash_scores_fn)(const uint16_t *qs, const uint16_t *kt, int64_t k0, flash_state *f);
typedef void (*flash_values_fn)(const uint16_t *vt, int64_t k0, flash_state *f);

static inline __attribute__((always_inline)) void group_rows(const tile_group *g, const uint16_t *kt,
                                                            const uint16_t *vt, flash_state *f,
                                                            flash_scores_fn block_scores, flash_values_fn block_values) {
    int64_t longest[NT] = {0}, most = 0;
    for (int t = 0; t < g->n; t++) {
        memset(f[t].acc, 0, sizeof f[t].acc);
        f[t].seen = 0; /* what a row has summed starts at its first key (block_softmax) */
        for (int r = 0; r < 16; r++) {
            longest[t] = g->len[t][r] > longest[t] ? g->len[t][r] : longest[t];
            most = longest[t] > most ? longest[t] : most;
        }
    }
    for (int64_t k0 = 0; k0 < most; k0 += KB) {
        for (int t = 0; t < g->n; t++)
            if (k0 < longest[t]) block_scores(g->qs[t], kt, k0, &f[t]);
        for (int t = 0; t < g->n; t++)
            for (int r = 0; r < 16 && k0 < longest[t]; r++) block_softmax(&f[t], r, g->len[t][r] - k0);
        for (int t = 0; t < g->n; t++)
            if (k0 < longest[t]) block_values(vt, k0, &f[t]);
    }
    for (int t = 0; t < g->n; t++)
        for (int r = 0; r < 16; r++) {
            float *dst = g->dst[t][r];
            if (!dst) continue;
            const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(_mm512_loadu_ps(f[t].sums[r])));
            for (int d = 0; d < HD; d += 16) _mm512_storeu_ps(dst + d, _mm512_mul_ps(_mm512_loadu_ps(f[t].acc[r] + d), inv));
        }
}

/* Rows [0, R) of a run x KV head kh, over its segment's packed keys and values (kt, vt as
 * uint16): the run's R x G query rows (G heads share the KV head) in groups of NT tiles;
 * `begin` and `end` (or NULL) around them (the AMX kernel's tile configuration). A tile's
 * queries are 16 rows of bf16 (each scaled query rounded to nearest even); with `split`, 16
 * more rows after them hold each query's remainder (scaled query less its bf16 value, rounded),
 * so that the scores can take the query to ~16 significant bits. */
static inline __attribute__((always_inline)) int flash_run(const float *q, const uint16_t *kt, const uint16_t *vt,
                                                          const int64_t *lens, float *out, int R, int H, int KVH,
                                                          int kh, float scale, flash_scores_fn block_scores,
                                                          flash_values_fn block_values, void (*begin)(void),
                                                          void (*end)(void), const int split) {
    const int G = H / KVH, M = R * G, Mp = (M + 15) & ~15, tile = (split ? 32 : 16) * HD;
    uint16_t *qs = aligned_alloc(64, (size_t)Mp / 16 * tile * 2 + NT * sizeof(flash_state));
    if (!qs) return -1;
    flash_state *f = (flash_state *)(qs + (size_t)Mp / 16 * tile);
    memset(qs, 0, (size_t)Mp / 16 * tile * 2);
    const __m512 sc = _mm512_set1_ps(scale);
    for (int i = 0; i < M; i++) {
        const float *src = q + ((size_t)(i / G) * H + (size_t)kh * G + i % G) * HD;
        uint16_t *dst = qs + (size_t)(i / 16) * tile + (size_t)(i % 16) * HD;
        for (int d = 0; d < HD; d += 16) {
            const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(src + d), sc);
            const __m256i hi = (__m256i)_mm512_cvtneps_pbh(x);
            _mm256_storeu_si256((__m256i *)(dst + d), hi);
            if (split) { /* x less hi exactly (fp32 has the bits), rounded to bf16 */
                const __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
                _mm256_storeu_si256((__m256i *)(dst + 16 * HD + d), (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(x, back)));
            }
        }
    }
    if (begin) begin();
    for (int t0 = 0; t0 < Mp / 16; t0 += NT) {
        tile_group g = {.n = Mp / 16 - t0 < NT ? Mp / 16 - t0 : NT};
        for (int t = 0; t < g.n; t++) {
            g.qs[t] = qs + (size_t)(t0 + t) * tile;
            for (int r = 0; r < 16; r++) {
                const int i = (t0 + t) * 16 + r;
                g.len[t][r] = i < M ? lens[i / G] : 0;
                g.dst[t][r] = i < M ? out + ((size_t)(i / G) * H + (size_t)kh * G + i % G) * HD : NULL;
            }
        }
        group_rows(&g, kt, vt, f, block_scores, block_values);
    }
    if (end) end();
    free(qs);
    return 0;
}

/* Whether row i + 1 continues row i's run: the next position over the same blocks. */
static int continues(const int64_t *tables, const int64_t *lens, int i, int bs, int max_blocks) {
    if (lens[i + 1] != lens[i] + 1) return 0;
    const int64_t nblk = (lens[i + 1] + bs - 1) / bs;
    return memcmp(tables + (size_t)i * max_blocks, tables + (size_t)(i + 1) * max_blocks,
                  sizeof(int64_t) * (size_t)nblk) == 0;
}

/* The entry points' body: q (B, H, 64) fp32 prompt rows; caches and tables as
 * paged_decode_attention_f32 takes them (fmt KV_F32 or KV_BF16); out (B, H, 64); `run_item` a run's
 * rows x one KV head (flash_run with the kernel's block products). Segments (maximal runs) pack their keys and values
 * once per KV head, in parallel over chunks of 32 keys (whole blocks of KB); then runs of up to
 * AROWS rows attend.
 * 0 done, -1 no memory, -2 not this kernel's case. */
typedef int (*flash_run_fn)(const float *q, const uint16_t *kt, const uint16_t *vt, const int64_t *lens, float *out,
                            int R, int H, int KVH, int kh, float scale);

static int flash_prompt_attention(const float *q, const void *kc, const void *vc, const int64_t *tables,
                                  const int64_t *lens, float *out, int B, int H, int KVH, int D, int bs,
                                  int max_blocks, float scale, int nthreads, int fmt, flash_run_fn run_item) {
    if (D != HD || (fmt != KV_F32 && fmt != KV_BF16) || H % KVH || H / KVH > 16) return -2;
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
        chunks += 2 * ((lens[seg[s + 1] - 1] + KB - 1) / KB); /* whole blocks of KB keys */
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
            failed |= run_item(q + off, (const uint16_t *)(base + (size_t)chunk0[s] * 1024),
                               (const uint16_t *)(base + (size_t)(chunks + chunk0[s]) * 1024), lens + r0, out + off,
                               run[w / KVH + 1] - r0, H, KVH, kh, scale) != 0;
        }
    }
    free(packs);
    free(seg);
    return failed ? -1 : 0;
}
#endif
#endif
