/* Temperature sampling of logit rows by the inverse CDF, fp32, one pass to the max, one to
 * the exponentials and one walk to the drawn token: what softmax, cumsum and searchsorted did
 * as three torch ops per row (and a Python call per row: 7 ms of a 32-row decode step here).
 *
 * Row r (logits + rows[r] * stride, V entries) with inverse temperature inv_t[r] and uniform
 * u[r] in [0, 1) gives the first token i whose cumulative weight exceeds u * S, where token
 * i weighs exp((l_i - max l) * inv_t) and S is the sum of all weights. A -inf logit (masked
 * by a grammar, min_tokens or truncation) weighs exactly 0, so it is never drawn. Sums run
 * in a fixed order per row, so a row's token depends only on its logits, inv_t and u (not on
 * the batch or the thread count). */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef __AVX2__
#include "vecmath.h"
#endif

#define BLK 64 /* weights per partial sum: the walk skips whole blocks */

/* Weights of one row into w (V floats) and their block sums into bs; returns S. */
static float weights(const float *l, int64_t V, float m, float inv_t, float *w, float *bs) {
    float total = 0.f;
    for (int64_t b0 = 0; b0 < V; b0 += BLK) {
        const int64_t b1 = b0 + BLK < V ? b0 + BLK : V;
        int64_t i = b0;
        float s = 0.f;
#ifdef __AVX2__
        const __m256 mv = _mm256_set1_ps(m), tv = _mm256_set1_ps(inv_t), ninf = _mm256_set1_ps(-INFINITY);
        __m256 acc = _mm256_setzero_ps();
        for (; i + 8 <= b1; i += 8) {
            const __m256 x = _mm256_loadu_ps(l + i);
            __m256 e = exp8(_mm256_mul_ps(_mm256_sub_ps(x, mv), tv));
            e = _mm256_and_ps(e, _mm256_cmp_ps(x, ninf, _CMP_NEQ_OQ)); /* exp8 clamps: -inf must give 0 */
            _mm256_storeu_ps(w + i, e);
            acc = _mm256_add_ps(acc, e);
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, acc);
        for (int j = 0; j < 8; j++) s += lanes[j];
#endif
        for (; i < b1; i++) {
            w[i] = l[i] == -INFINITY ? 0.f : expf((l[i] - m) * inv_t);
            s += w[i];
        }
        bs[b0 / BLK] = s;
        total += s;
    }
    return total;
}

static float row_max(const float *l, int64_t V) {
    float m = -INFINITY;
    int64_t i = 0;
#ifdef __AVX2__
    __m256 mv = _mm256_set1_ps(-INFINITY);
    for (; i + 8 <= V; i += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(l + i));
    float lanes[8];
    _mm256_storeu_ps(lanes, mv);
    for (int j = 0; j < 8; j++) m = lanes[j] > m ? lanes[j] : m;
#endif
    for (; i < V; i++) m = l[i] > m ? l[i] : m;
    return m;
}

static int64_t first_of(const float *l, int64_t V, float m) {
    for (int64_t i = 0; i < V; i++)
        if (l[i] == m) return i;
    return 0;
}

static int64_t draw_row(const float *l, int64_t V, float inv_t, float u, float *w, float *bs) {
    const float m = row_max(l, V);
    if (m == -INFINITY || !(inv_t > 0.f)) return first_of(l, V, m); /* nothing drawable, or greedy */
    const float target = u * weights(l, V, m, inv_t, w, bs);
    float acc = 0.f;
    const int64_t nb = (V + BLK - 1) / BLK;
    for (int64_t b = 0; b < nb; b++) {
        if (acc + bs[b] <= target) {
            acc += bs[b];
            continue;
        }
        const int64_t b1 = (b + 1) * BLK < V ? (b + 1) * BLK : V;
        int64_t last = -1;
        for (int64_t i = b * BLK; i < b1; i++) {
            if (w[i] > 0.f) last = i;
            acc += w[i];
            if (acc > target && w[i] > 0.f) return i;
        }
        if (last >= 0) return last; /* the block's sum and its running sum rounded apart */
    }
    return first_of(l, V, m); /* u * S rounded above the running total: the most likely token */
}

/* tokens[r] for R rows; returns 0, or -1 without scratch memory. */
int sample_rows_f32(const float *logits, int64_t V, int64_t stride, int64_t R, const int64_t *rows,
                    const float *inv_t, const float *u, int64_t *tokens, int nthreads) {
    int failed = 0;
    if (nthreads < 1) nthreads = 1;
#pragma omp parallel num_threads(nthreads) if (R > 1)
    {
        float *w = malloc(sizeof(float) * (size_t)(V + (V + BLK - 1) / BLK));
        if (!w) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < R; r++)
            if (w) tokens[r] = draw_row(logits + rows[r] * stride, V, inv_t[r], u[r], w, w + V);
        free(w);
    }
    return failed ? -1 : 0;
}

/* The first index of the row's largest value, a NaN counting as larger than any number (what
 * torch.argmax returns): one pass for the max and whether a NaN is there, one to its first
 * occurrence (-0 and +0 are equal, as in any comparison). */
static int64_t argmax_row(const float *l, int64_t V) {
    float m = -INFINITY;
    int nan = 0;
    int64_t i = 0;
#ifdef __AVX2__
    __m256 mv = _mm256_set1_ps(-INFINITY), un = _mm256_setzero_ps();
    for (; i + 8 <= V; i += 8) {
        const __m256 x = _mm256_loadu_ps(l + i);
        mv = _mm256_max_ps(mv, x);
        un = _mm256_or_ps(un, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, mv);
    for (int j = 0; j < 8; j++) m = lanes[j] > m ? lanes[j] : m;
    nan = _mm256_movemask_ps(un) != 0;
#endif
    for (; i < V; i++) {
        m = l[i] > m ? l[i] : m;
        nan |= l[i] != l[i];
    }
    if (nan) {
        for (i = 0; i < V; i++)
            if (l[i] != l[i]) return i;
    }
    i = 0;
#ifdef __AVX2__
    const __m256 target = _mm256_set1_ps(m);
    for (; i + 8 <= V; i += 8) {
        const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(l + i), target, _CMP_EQ_OQ));
        if (hit) return i + __builtin_ctz((unsigned)hit);
    }
#endif
    for (; i < V; i++)
        if (l[i] == m) return i;
    return 0; /* V == 0 */
}

/* tokens[r] = the argmax of row rows[r] (logits + rows[r] * stride, V entries), for R rows. */
void argmax_rows_f32(const float *logits, int64_t V, int64_t stride, int64_t R, const int64_t *rows,
                     int64_t *tokens, int nthreads) {
    if (nthreads < 1) nthreads = 1;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (R > 1)
    for (int64_t r = 0; r < R; r++) tokens[r] = argmax_row(logits + rows[r] * stride, V);
}
