/* bf16_attention.c - long prompt rows' attention with AVX-512 BF16 (vdpbf16ps), no tiles
 *
 * Where the CPU has AVX-512 BF16 and the build targets it (cpu.py `bf16_vectors`: AMD, a Zen 4),
 * "auto" runs the attention of prompt rows from position BF16_ATTENTION_FROM on
 * (engine/kernels/attention.py) with flash.h's kernel and the two block products below, in
 * 512-bit vectors: 32 bf16 products an instruction, summed in fp32, against 16 fp32
 * multiply-adds for the fp32 kernel (attention_rows.c). The scaled query is two bf16 halves (its
 * value and the rest: flash_run's `split`), both multiplied into the scores, so a score's error
 * is not the query's bf16 rounding times |k| (which cost 0.7% perplexity over 1,024 tokens);
 * the numerators are rounded to bf16 as on AMX. Scores: a lane per key, 4 query rows x 64 keys
 * a pass (16 accumulators; each key vector feeds 4 rows, each query pair broadcast 4 key
 * chunks). Values: a lane per dimension, 4 rows x 64 dimensions a pass, each value vector
 * feeding 4 rows. Every row's sums run in one order whatever the other rows of its tile, so a
 * row's result depends on that row only. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "attend.h"
#include "flash.h"

#ifdef PDSERVE_FLASH

/* The tile's scores against keys [k0, k0 + KB) into f->s: each query's two halves (rows r and
 * 16 + r of qs) in turn into one sum. Keys in pack_chunk's layout: per 16 keys, 32 vectors,
 * vector p holding pair p (dimensions 2p, 2p + 1) of each of the 16 keys. */
static inline void vec_scores(const uint16_t *qs, const uint16_t *kt, int64_t k0, flash_state *f) {
    const uint32_t *k = (const uint32_t *)kt + (size_t)(k0 / 16) * 512;
    for (int r0 = 0; r0 < 16; r0 += 4) {
        const uint32_t *q = (const uint32_t *)(qs + (size_t)r0 * HD);
        __m512 acc[4][4];
        for (int i = 0; i < 4; i++)
            for (int c = 0; c < 4; c++) acc[i][c] = _mm512_setzero_ps();
        for (int p = 0; p < HD / 2; p++) {
            __m512bh kv[4];
            for (int c = 0; c < 4; c++) kv[c] = (__m512bh)_mm512_loadu_si512((const void *)(k + (c * 32 + p) * 16));
            for (int i = 0; i < 4; i++) {
                const __m512bh qp = (__m512bh)_mm512_set1_epi32((int)q[i * HD / 2 + p]);
                const __m512bh ql = (__m512bh)_mm512_set1_epi32((int)q[(16 + i) * HD / 2 + p]);
                for (int c = 0; c < 4; c++) acc[i][c] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[i][c], qp, kv[c]), ql, kv[c]);
            }
        }
        for (int i = 0; i < 4; i++)
            for (int c = 0; c < 4; c++) _mm512_storeu_ps(f->s[r0 + i] + 16 * c, acc[i][c]);
    }
}

/* f->acc plus the block's numerators (f->p, bf16, pairs of consecutive keys) times values
 * [k0, k0 + KB). Values in pack_chunk's layout: per 32 keys, 4 quarters of the dimensions x 16
 * key pairs, each vector the pair's two values of 16 dimensions. */
static inline void vec_values(const uint16_t *vt, int64_t k0, flash_state *f) {
    const uint32_t *v = (const uint32_t *)vt + (size_t)(k0 / 32) * 1024;
    for (int r0 = 0; r0 < 16; r0 += 4) {
        __m512 acc[4][4];
        for (int i = 0; i < 4; i++)
            for (int u = 0; u < 4; u++) acc[i][u] = _mm512_loadu_ps(f->acc[r0 + i] + 16 * u);
        for (int kp = 0; kp < KB / 2; kp++) { /* key pairs: 16 a 32-key chunk */
            const uint32_t *vp = v + (size_t)(kp / 16) * 1024 + (kp % 16) * 16;
            __m512bh vv[4];
            for (int u = 0; u < 4; u++) vv[u] = (__m512bh)_mm512_loadu_si512((const void *)(vp + u * 256));
            for (int i = 0; i < 4; i++) {
                const __m512bh pp = (__m512bh)_mm512_set1_epi32((int)((const uint32_t *)f->p[r0 + i])[kp]);
                for (int u = 0; u < 4; u++) acc[i][u] = _mm512_dpbf16_ps(acc[i][u], pp, vv[u]);
            }
        }
        for (int i = 0; i < 4; i++)
            for (int u = 0; u < 4; u++) _mm512_storeu_ps(f->acc[r0 + i] + 16 * u, acc[i][u]);
    }
}

static int vec_run(const float *q, const uint16_t *kt, const uint16_t *vt, const int64_t *lens, float *out, int R,
                   int H, int KVH, int kh, float scale) {
    return flash_run(q, kt, vt, lens, out, R, H, KVH, kh, scale, vec_scores, vec_values, NULL, NULL, 1);
}

int bf16_attention_available(void) { return 1; }

/* q (B, H, 64) fp32 prompt rows; caches and tables as paged_decode_attention_f32 takes them
 * (fmt KV_F32 or KV_BF16); out (B, H, 64). 0 done, -1 no memory, -2 not this kernel's case. */
int bf16_prompt_attention(const float *q, const void *kc, const void *vc, const int64_t *tables, const int64_t *lens,
                          float *out, int B, int H, int KVH, int D, int bs, int max_blocks, float scale, int nthreads,
                          int fmt) {
    return flash_prompt_attention(q, kc, vc, tables, lens, out, B, H, KVH, D, bs, max_blocks, scale, nthreads, fmt,
                                  vec_run);
}

#else
int bf16_attention_available(void) { return 0; }

FLASH_ABSENT(bf16_prompt_attention)
#endif
