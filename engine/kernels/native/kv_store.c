/* Writing new K/V rows into an 8-bit cache (engine/kv/formats.py), kvformat.h's kv_encode_row
 * per (token, head) row, in one call per tensor; and decoding whole tensors back to fp32. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kvformat.h"

/* Store T new K (or V) rows (T, KVH, D) fp32 into an 8-bit cache (KV_INT8 / KV_FP8) at flat
 * slots `slots` (T,); an all-zero row gets scale 1. */
void kv_store_8bit(const float *x, void *cache, const int64_t *slots, int T, int KVH, int D, int fmt, int nthreads) {
    const size_t hrow = head_row_bytes(fmt, D);
    /* a step's few new rows in this thread; a whole prompt's KV (wire conversion) on all */
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T * KVH >= 8192)
    for (int r = 0; r < T * KVH; r++)
        kv_encode_row(x + (size_t)r * D, (uint8_t *)cache + ((size_t)slots[r / KVH] * KVH + r % KVH) * hrow, D, fmt);
}

/* The inverse, for whole tensors (a hand-off landing in another format): n rows of D codes
 * and a scale -> n * D fp32, code * scale, as kv_format.decode computes it. */
void kv_load_8bit(const void *rows, float *out, int64_t n, int D, int fmt, int nthreads) {
    const size_t hrow = head_row_bytes(fmt, D);
#pragma omp parallel for num_threads(nthreads) schedule(static) if (n >= 8192)
    for (int64_t r = 0; r < n; r++) {
        const char *src = (const char *)rows + (size_t)r * hrow;
        const float scale = row_scale(src, fmt, D);
        for (int i = 0; i < D; i++) out[(size_t)r * D + i] = kv_at(src, i, fmt) * scale;
    }
}
