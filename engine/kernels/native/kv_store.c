/* Writing new K/V rows into an 8-bit cache (engine/kv/formats.py): per (token, head) row the
 * codes of x / scale, scale = absmax / qmax, then the scale -- bit for bit what
 * kv_format.encode_reference writes with torch ops, in one call per tensor; and decoding
 * whole tensors back to fp32. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kvformat.h"

/* fp32 -> fp8 e4m3fn, rounded to nearest even (as torch converts), |v| saturated at 448. */
static inline uint8_t f32_to_fp8(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80);
    const float a = fabsf(v);
    if (!(a < 448.f)) return sign | 0x7e;
    if (a < 0.015625f) return sign | (uint8_t)nearbyintf(a * 512.f); /* subnormal: m * 2^-9 (8: the least normal) */
    memcpy(&u, &a, 4);
    u = (u + 0x7ffff + ((u >> 20) & 1)) >> 20; /* exponent and 3 mantissa bits, the rest rounded off */
    const uint32_t code = u - (120u << 3);      /* exponent bias 127 -> 7 */
    return sign | (uint8_t)(code > 0x7e ? 0x7e : code);
}

/* Store T new K (or V) rows (T, KVH, D) fp32 into an 8-bit cache (KV_INT8 / KV_FP8) at flat
 * slots `slots` (T,); an all-zero row gets scale 1. */
void kv_store_8bit(const float *x, void *cache, const int64_t *slots, int T, int KVH, int D, int fmt, int nthreads) {
    const float qmax = fmt == KV_INT8 ? 127.f : 448.f;
    const size_t hrow = head_row_bytes(fmt, D);
    /* a step's few new rows in this thread; a whole prompt's KV (wire conversion) on all */
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T * KVH >= 8192)
    for (int r = 0; r < T * KVH; r++) {
        const float *src = x + (size_t)r * D;
        uint8_t *dst = (uint8_t *)cache + ((size_t)slots[r / KVH] * KVH + r % KVH) * hrow;
        float amax = 0.f;
        for (int i = 0; i < D; i++) amax = fabsf(src[i]) > amax ? fabsf(src[i]) : amax;
        const float scale = amax > 0.f ? amax / qmax : 1.f;
        if (fmt == KV_INT8)
            for (int i = 0; i < D; i++) {
                float c = nearbyintf(src[i] / scale);
                ((int8_t *)dst)[i] = (int8_t)(c > 127.f ? 127.f : c < -127.f ? -127.f : c);
            }
        else
            for (int i = 0; i < D; i++) dst[i] = f32_to_fp8(src[i] / scale);
        memcpy(dst + D, &scale, 4);
    }
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
