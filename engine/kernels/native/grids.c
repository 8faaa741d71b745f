/* grids.c - whether an fp32 matrix is exactly a Q4_1 or a Q8_0 grid (groups of 32 along K), and
 * its packed form if so: what GGUF checkpoints dequantize to, found again at every model load
 * (engine/model/quant.py `exact_grid`). The arithmetic is weight_formats.py's quantizers', op
 * for op in fp32 (round half to even, no fused multiply-adds), so the packed form is bitwise
 * theirs; a matrix is a grid when re-quantizing it moves no weight by more than rel_tol x its
 * largest |w|. One pass over the matrix after its largest |w|, stopping at the first group
 * that is off the grid (most matrices that are not grids fail in their first group).
 */
#pragma GCC optimize("fp-contract=off")
#include <math.h>
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

static float largest_abs(const float *w, int64_t n, int threads) {
    float top = 0.0f;
    int nan = 0;
#pragma omp parallel for num_threads(threads) reduction(max : top) reduction(| : nan) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        float a = fabsf(w[i]);
        nan |= a != a;
        top = a > top ? a : top;
    }
    return nan ? NAN : top;
}

/* the smallest and largest of a group's 32 weights */
static inline void group_range(const float *x, float *lo, float *hi) {
    float a = x[0], b = x[0];
    for (int i = 1; i < 32; i++) {
        a = x[i] < a ? x[i] : a;
        b = x[i] > b ? x[i] : b;
    }
    *lo = a;
    *hi = b;
}

static float tolerance(const float *w, int64_t n, float rel_tol, int threads) {
    float top = largest_abs(w, n, threads);
    return rel_tol * (top > 1e-30f ? top : 1e-30f); /* NaN stays NaN: no error is <= it */
}

/* a Q4_1 group: its codes packed into out (16 bytes), its step and minimum; 0 if it is off the grid */
static inline int q4_1_group(const float *x, float tol, uint8_t *out, float *d, float *m) {
    float lo, hi;
    group_range(x, &lo, &hi);
    const float step = (hi - lo) / 15.0f;
    const float inv = step > 0.0f ? 1.0f / step : 0.0f;
    uint8_t q[32];
    for (int i = 0; i < 32; i++) {
        float v = nearbyintf((x[i] - lo) * inv);
        v = v < 0.0f ? 0.0f : (v > 15.0f ? 15.0f : v);
        float back = v * step;
        back = back + lo;
        if (!(fabsf(back - x[i]) <= tol))
            return 0;
        q[i] = (uint8_t)v;
    }
    for (int i = 0; i < 16; i++)
        out[i] = (uint8_t)(q[i] | (q[i + 16] << 4));
    *d = step;
    *m = lo;
    return 1;
}

/* a Q8_0 group: its codes into out (32 bytes) and its step; 0 if it is off the grid */
static inline int q8_0_group(const float *x, float tol, int8_t *out, float *d) {
    float lo, hi;
    group_range(x, &lo, &hi);
    const float top = hi > -lo ? hi : -lo;
    const float step = top / 127.0f;
    const float inv = step > 0.0f ? 1.0f / step : 0.0f;
    for (int i = 0; i < 32; i++) {
        float v = nearbyintf(x[i] * inv);
        v = v < -127.0f ? -127.0f : (v > 127.0f ? 127.0f : v);
        if (!(fabsf(v * step - x[i]) <= tol))
            return 0;
        out[i] = (int8_t)v;
    }
    *d = step;
    return 1;
}

/* every group of w (n, k) through its format's check (q8: Q8_0, else Q4_1), rows split over the
 * threads, all stopping once one group is off the grid; 1 if none was */
static int grids(const float *w, int64_t n, int64_t k, float rel_tol, int q8, void *codes, float *d, float *m,
                 int threads) {
    const float tol = tolerance(w, n * k, rel_tol, threads);
    const int64_t groups = k / 32;
    int off = tol != tol;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < n; r++) {
        for (int64_t j = 0; j < groups && !__atomic_load_n(&off, __ATOMIC_RELAXED); j++) {
            const float *x = w + r * k + 32 * j;
            const int64_t g = r * groups + j;
            int ok = q8 ? q8_0_group(x, tol, (int8_t *)codes + r * k + 32 * j, d + g)
                        : q4_1_group(x, tol, (uint8_t *)codes + r * (k / 2) + 16 * j, d + g, m + g);
            if (!ok) {
                __atomic_store_n(&off, 1, __ATOMIC_RELAXED);
                break;
            }
        }
    }
    return !off;
}

/* 1 and the packed form (p (n, k/2), d and m (n, k/32)) if w (n, k) is a Q4_1 grid, else 0 */
int grid_q4_1(const float *w, int64_t n, int64_t k, float rel_tol, uint8_t *p, float *d, float *m, int threads) {
    return grids(w, n, k, rel_tol, 0, p, d, m, threads);
}

/* 1 and the packed form (q (n, k) int8, d (n, k/32)) if w (n, k) is a Q8_0 grid, else 0 */
int grid_q8_0(const float *w, int64_t n, int64_t k, float rel_tol, int8_t *q, float *d, int threads) {
    return grids(w, n, k, rel_tol, 1, q, d, 0, threads);
}
