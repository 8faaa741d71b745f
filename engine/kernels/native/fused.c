/* Fused elementwise kernels of the decoder layer, fp32, in place or into one output: each
 * replaces several torch ops that every read and write the whole activation (RoPE was five
 * per q and k, SwiGLU's silu-times-up two plus a chunk), a tenth of a prefill step's time. */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#ifdef __AVX2__
#include "vecmath.h"
#endif

/* out (T, I) = silu(gu[:, :I]) * gu[:, I:], gu (T, 2I) contiguous: the gate and up halves
 * of the fused gate/up projection. silu(g) = g / (1 + exp(-g)). */
void silu_mul_f32(const float *gu, float *out, int64_t T, int64_t I, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T * I >= 65536)
    for (int64_t t = 0; t < T; t++) {
        const float *g = gu + t * 2 * I, *u = g + I;
        float *o = out + t * I;
        int64_t i = 0;
#ifdef __AVX2__
        const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
        for (; i + 8 <= I; i += 8) {
            __m256 x = _mm256_loadu_ps(g + i);
            __m256 s = _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, x))));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
        }
#endif
        for (; i < I; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* RoPE in place (Hugging Face's rotate-half layout) on the first `heads` heads of hd floats
 * of each of T rows of x (rows `stride` floats apart: the q and k parts of a fused qkv row):
 * with c, s the cos/sin table rows (hd floats; both halves equal) at the row's position,
 *   x[j]      <- x[j] c[j] - x[j+h] s[j]
 *   x[j+h]    <- x[j+h] c[j+h] + x[j] s[j+h]       (j < h = hd / 2) */
void rope_f32(float *x, int64_t T, int64_t stride, int heads, int hd, const float *cos_t, const float *sin_t,
              const int64_t *positions, int nthreads) {
    const int h = hd / 2;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T * heads * hd >= 65536)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_t + positions[t] * hd, *s = sin_t + positions[t] * hd;
        for (int head = 0; head < heads; head++) {
            float *p = x + t * stride + (int64_t)head * hd;
            int j = 0;
#ifdef __AVX2__
            for (; j + 8 <= h; j += 8) {
                __m256 a = _mm256_loadu_ps(p + j), b = _mm256_loadu_ps(p + h + j);
                __m256 ca = _mm256_loadu_ps(c + j), sa = _mm256_loadu_ps(s + j);
                __m256 cb = _mm256_loadu_ps(c + h + j), sb = _mm256_loadu_ps(s + h + j);
                _mm256_storeu_ps(p + j, _mm256_sub_ps(_mm256_mul_ps(a, ca), _mm256_mul_ps(b, sa)));
                _mm256_storeu_ps(p + h + j, _mm256_add_ps(_mm256_mul_ps(b, cb), _mm256_mul_ps(a, sb)));
            }
#endif
            for (; j < h; j++) {
                float a = p[j], b = p[h + j];
                p[j] = a * c[j] - b * s[j];
                p[h + j] = b * c[h + j] + a * s[h + j];
            }
        }
    }
}

/* The residual stream's add and the next RMSNorm in one pass per row (T rows of D):
 *   h += delta (in place; delta may be NULL: the norm alone), out = h / sqrt(mean(h^2) + eps) * w
 * torch's rms_norm ran as five ops here (pow, mean, add, rsqrt, mul: ~0.4 ms a call on a
 * 257-token prefill, 61 calls), and each residual add as one more pass. */
void add_rms_norm_f32(float *h, const float *delta, const float *w, float *out, int64_t T, int64_t D, float eps,
                      int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (T * D >= 65536)
    for (int64_t t = 0; t < T; t++) {
        float *x = h + t * D, *o = out + t * D;
        const float *d = delta ? delta + t * D : NULL;
        int64_t i = 0;
        float ss = 0.f;
#ifdef __AVX2__
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        for (; i + 16 <= D; i += 16) {
            __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
            if (d) {
                v0 = _mm256_add_ps(v0, _mm256_loadu_ps(d + i));
                v1 = _mm256_add_ps(v1, _mm256_loadu_ps(d + i + 8));
                _mm256_storeu_ps(x + i, v0);
                _mm256_storeu_ps(x + i + 8, v1);
            }
            a0 = _mm256_fmadd_ps(v0, v0, a0);
            a1 = _mm256_fmadd_ps(v1, v1, a1);
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, _mm256_add_ps(a0, a1));
        for (int j = 0; j < 8; j++) ss += lanes[j];
#endif
        for (; i < D; i++) {
            if (d) x[i] += d[i];
            ss += x[i] * x[i];
        }
        const float r = 1.0f / sqrtf(ss / (float)D + eps);
        i = 0;
#ifdef __AVX2__
        const __m256 rv = _mm256_set1_ps(r);
        for (; i + 8 <= D; i += 8)
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), rv), _mm256_loadu_ps(w + i)));
#endif
        for (; i < D; i++) o[i] = x[i] * r * w[i];
    }
}
