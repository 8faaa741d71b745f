/* lora.c - LoRA updates of a step's rows: y[row] += B (A x[row]), per row its own adapter
 *
 * The gathered form of punica's / S-LoRA's batched LoRA: each row of the flat batch names its
 * adapter (or none), and the update is computed per row from that adapter's A (r, in) and B,
 * held transposed (bt: (r, out)), scaling folded into B. lora_row is the one routine: the
 * Python path (engine/model/lora_batch.py, lora_rows_f32) and the C decode step (step.c) both
 * call it, so a row's result is bitwise the same on either path, whatever its batch, its place
 * in it, or the split of the output columns between threads:
 *   t[j] = sum_k A[j][k] x[k]   (8 lanes over k, reduced in a fixed order, then the tail)
 *   y[n] += sum_j t[j] bt[j][n] (j in order, vectorised over n)
 */
#include <stdint.h>
#include <stdlib.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

/* t (r) = A (r, K) x (K). */
void lora_shrink(const float *x, int64_t K, const float *a, int64_t r, float *t) {
    for (int64_t j = 0; j < r; j++) {
        const float *aj = a + j * K;
        int64_t k = 0;
        float s = 0.f;
#ifdef __AVX2__
        __m256 acc = _mm256_setzero_ps();
        for (; k + 8 <= K; k += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(aj + k), _mm256_loadu_ps(x + k), acc);
        float lanes[8];
        _mm256_storeu_ps(lanes, acc);
        s = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
#endif
        for (; k < K; k++) s += aj[k] * x[k];
        t[j] = s;
    }
}

/* y[n0:n1) += t (r) bt (r, N)[:, n0:n1). */
void lora_expand(const float *t, int64_t r, const float *bt, int64_t N, float *y, int64_t n0, int64_t n1) {
    for (int64_t j = 0; j < r; j++) {
        const float *bj = bt + j * N;
        const float tj = t[j];
        int64_t n = n0;
#ifdef __AVX2__
        const __m256 tv = _mm256_set1_ps(tj);
        for (; n + 8 <= n1; n += 8) _mm256_storeu_ps(y + n, _mm256_fmadd_ps(tv, _mm256_loadu_ps(bj + n), _mm256_loadu_ps(y + n)));
#endif
        for (; n < n1; n++) y[n] = __builtin_fmaf(tj, bj[n], y[n]);
    }
}

/* y (M, N) += the update of x (M, K) at `rows` (nrows of them; NULL: every row); a (r, K),
 * bt (r, N) fp32 contiguous. Threads split the rows. Returns 0, or -1 without scratch memory. */
int lora_rows_f32(const float *x, int64_t K, float *y, int64_t N, int64_t M, const int64_t *rows, int64_t nrows,
                  const float *a, const float *bt, int64_t r, int nt) {
    const int64_t n = rows ? nrows : M;
    int failed = 0;
#pragma omp parallel num_threads(nt < 1 ? 1 : nt) reduction(| : failed)
    {
        float *t = malloc(sizeof(float) * (size_t)(r > 0 ? r : 1));
        if (!t) failed = 1;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n; i++) {
            if (!t) continue;
            const int64_t row = rows ? rows[i] : i;
            lora_shrink(x + row * K, K, a, r, t);
            lora_expand(t, r, bt, N, y + row * N, 0, N);
        }
        free(t);
    }
    return failed ? -1 : 0;
}
