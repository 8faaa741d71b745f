/* Paged attention over a step's rows: runs of rows that are consecutive positions of one
 * sequence (a prompt chunk's tokens, a speculative draft) attend together.
 *
 * A prompt of L tokens has L query rows, row i over keys 0..i. One row at a time, every row
 * reads its whole prefix of K and V again: a 2,000-token prompt reads ~1 MB per KV head and
 * layer per row, from L3 or memory, and attention took over half of its prefill. Here up to
 * ROWS rows of one run share each block's read: block by block, every row of the run that
 * sees the block computes its scores (then, after the softmax, its weighted values) while the
 * block is in L1. Each (row, head, block) runs the same attend.h code as the one-row kernel,
 * in the same order within the row, so every row's result is the one-row kernel's bits: batch
 * invariance holds whether a prompt arrives whole, chunked or after a cached prefix.
 *
 * Rows form a run when each next row is the previous row's position + 1 (lens + 1) with the
 * same skip and the same block table over the blocks it sees. Single rows (decode steps),
 * 8-bit caches (their prefill rows attend over a decoded fp32 copy, which does run here) and
 * head dims other than 64 take the one-row kernel (attention.c's paged_attention_item); a step
 * of single rows only, two a thread at least, runs a row (all its KV heads) an item
 * (paged_attention_row). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "attend.h"

#define ROWS 16 /* rows of one run per work item: their scores (ROWS x G x len floats) stay in L2 at 2k tokens */

int paged_attention_item(const float *q, const void *kc, const void *vc, const int64_t *tables, const int64_t *lens,
                         const int64_t *skips, float *out, int w, int H, int KVH, int D, int bs, int max_blocks,
                         float scale, int kv_fmt);
int paged_attention_row(const float *q, const void *kc, const void *vc, const int64_t *tables, const int64_t *lens,
                        const int64_t *skips, float *out, int b, int H, int KVH, int D, int bs, int max_blocks,
                        float scale, int kv_fmt);

#ifdef __AVX2__
/* Rows [r0, r0 + R) of one run x KV head kh (D = 64, fmt KV_F32 or KV_BF16). work: bs*64 +
 * R*G*(QV_N*64/AV_C + 64 + 1 + lens[R-1]) floats: a block's widened rows, the (row, head) pairs'
 * prepared queries and value sums, their softmax sums and scores. */
static inline __attribute__((always_inline)) void attend_run_d64(const float *q, const char *kc, const char *vc,
                                                                const int64_t *table, const int64_t *lens,
                                                                int64_t skip, float *out, int R, int H, int KVH,
                                                                int kh, int bs, float scale, float *work,
                                                                const int fmt) {
    enum { D = 64 };
    const int G = H / KVH, RG = R * G;
    const size_t hrow = head_row_bytes(fmt, D), row = (size_t)KVH * hrow;
    const int64_t Lmax = lens[R - 1], nblk = (Lmax + bs - 1) / bs;
    enum { QF = QV_N * 64 / AV_C }; /* floats of one prepared query */
    float *buf = work, *qs = buf + (size_t)bs * D, *acc = qs + (size_t)RG * QF, *sums = acc + (size_t)RG * D;
    float *scores = sums + RG;
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++) {
            avec v[QV_N];
            query_d64(q + ((size_t)r * H + (size_t)kh * G + g) * D, scale, v, READ_FMT(fmt));
            store_q_d64(v, qs + (size_t)(r * G + g) * QF);
        }
    for (int64_t b = 0; b < nblk; b++) {
        size_t stride;
        const char *kb = as_read(kc + ((size_t)table[b] * bs * KVH + kh) * hrow, row, bs, fmt, buf, &stride);
        for (int r = 0; r < R; r++) {
            if (b * bs >= lens[r]) continue;
            const int n = (int)((b + 1) * bs <= lens[r] ? bs : lens[r] - b * bs);
            for (int g = 0; g < G; g++) {
                avec qv[QV_N];
                load_q_d64(qs + (size_t)(r * G + g) * QF, qv);
                block_scores_d64(qv, kb, stride, n, scores + (size_t)(r * G + g) * Lmax + b * bs, READ_FMT(fmt));
            }
        }
    }
    for (int i = 0; i < RG; i++) {
        float *s = scores + (size_t)i * Lmax;
        mask_head(s, skip);
        sums[i] = softmax_numerators(s, lens[i / G]);
    }
    memset(acc, 0, sizeof(float) * (size_t)RG * D);
    for (int64_t b = 0; b < nblk; b++) {
        size_t stride;
        const char *vb = as_read(vc + ((size_t)table[b] * bs * KVH + kh) * hrow, row, bs, fmt, buf, &stride);
        for (int r = 0; r < R; r++) {
            if (b * bs >= lens[r]) continue;
            const int n = (int)((b + 1) * bs <= lens[r] ? bs : lens[r] - b * bs);
            for (int g = 0; g < G; g++) {
                float *a = acc + (size_t)(r * G + g) * D;
                avec v[AV_C];
                load_d64(a, v);
                block_values_d64(v, scores + (size_t)(r * G + g) * Lmax + b * bs, vb, stride, n, READ_FMT(fmt));
                store_d64(v, a);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++) {
            avec v[AV_C];
            load_d64(acc + (size_t)(r * G + g) * D, v);
            head_out_d64(v, sums[r * G + g], out + ((size_t)r * H + (size_t)kh * G + g) * D, READ_FMT(fmt));
        }
}
#endif

/* Whether row j continues row i = j - 1's run: the next position, same skip, same blocks. */
static int continues(const int64_t *tables, const int64_t *lens, const int64_t *skips, int i, int bs, int max_blocks) {
    const int j = i + 1;
    if (lens[j] != lens[i] + 1 || (skips && skips[j] != skips[i])) return 0;
    const int64_t nblk = (lens[j] + bs - 1) / bs;
    return memcmp(tables + (size_t)i * max_blocks, tables + (size_t)j * max_blocks, sizeof(int64_t) * (size_t)nblk) == 0;
}

/* Rows [r0, r0 + R) x KV head kh: together where the multi-row kernel applies, else row by row. */
static int run_item(const float *q, const void *kc, const void *vc, const int64_t *tables, const int64_t *lens,
                    const int64_t *skips, float *out, int r0, int R, int kh, int H, int KVH, int D, int bs,
                    int max_blocks, float scale, int fmt) {
#ifdef __AVX2__
    const int G = H / KVH;
    if (R > 1 && D == 64 && (fmt == KV_F32 || fmt == KV_BF16)) {
        float *work = malloc(sizeof(float) * ((size_t)bs * 64 + (size_t)R * G * (QV_N * 64 / AV_C + 64 + 1 + (size_t)lens[r0 + R - 1])));
        if (!work) return -1;
        const size_t qoff = (size_t)r0 * H * D;
        const int64_t *table = tables + (size_t)r0 * max_blocks, skip = skips ? skips[r0] : 0;
        if (fmt == KV_F32)
            attend_run_d64(q + qoff, kc, vc, table, lens + r0, skip, out + qoff, R, H, KVH, kh, bs, scale, work, KV_F32);
        else
            attend_run_d64(q + qoff, kc, vc, table, lens + r0, skip, out + qoff, R, H, KVH, kh, bs, scale, work, KV_BF16);
        free(work);
        return 0;
    }
#endif
    for (int r = r0; r < r0 + R; r++)
        if (paged_attention_item(q, kc, vc, tables, lens, skips, out, r * KVH + kh, H, KVH, D, bs, max_blocks, scale,
                                 fmt))
            return -1;
    return 0;
}

/* q (B, H, D), out (B, H, D); see attention.c for the layouts. Returns 0, or -1 when scratch
 * memory could not be allocated. kv_fmt: the caches' format (KV_*). */
int paged_decode_attention_f32(const float *q, const void *kc, const void *vc, const int64_t *tables,
                               const int64_t *lens, const int64_t *skips, float *out, int B, int H, int KVH, int D,
                               int bs, int max_blocks, float scale, int nthreads, int kv_fmt) {
    int *start = malloc(sizeof(int) * ((size_t)B + 1)), n = 0, failed = 0;
    if (!start) return -1;
    for (int r = 0; r < B; r++)
        if (r == 0 || r - start[n - 1] >= ROWS || !continues(tables, lens, skips, r - 1, bs, max_blocks)) start[n++] = r;
    start[n] = B;
    if (n == B && (nthreads == 1 || B >= 2 * nthreads)) { /* single rows, two a thread at least: a row an item */
        free(start);
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1) reduction(| : failed)
        for (int r = 0; r < B; r++)
            failed |= paged_attention_row(q, kc, vc, tables, lens, skips, out, r, H, KVH, D, bs, max_blocks, scale,
                                          kv_fmt) != 0;
        return failed ? -1 : 0;
    }
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1) reduction(| : failed)
    for (int w = 0; w < n * KVH; w++)
        failed |= run_item(q, kc, vc, tables, lens, skips, out, start[w / KVH], start[w / KVH + 1] - start[w / KVH],
                           w % KVH, H, KVH, D, bs, max_blocks, scale, kv_fmt) != 0;
    free(start);
    return failed ? -1 : 0;
}
