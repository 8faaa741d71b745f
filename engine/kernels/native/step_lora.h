/* step_lora.h - a step's LoRA adapters as step.c applies them (lora.c's routines, per row). */
#ifndef PDSERVE_STEP_LORA_H
#define PDSERVE_STEP_LORA_H
#include <stdint.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

void lora_shrink(const float *x, int64_t K, const float *a, int64_t r, float *t);
void lora_expand(const float *t, int64_t r, const float *bt, int64_t N, float *y, int64_t n0, int64_t n1);

/* A step's LoRA adapters (lora.c; NULL: none). Adapter s: ab[(layer * 4 + m) * 2] its A (r, in)
 * and [.. + 1] its B transposed (r, out) of fused matrix m (0 qkv, 1 o, 2 gate_up, 3 down),
 * ranks[layer * 4 + m] r (0: not updated); row_slot (M,) each row's adapter, -1 the base. */
typedef struct {
    void *const *ab;
    const int64_t *ranks;
} lora_adapter;
typedef struct {
    int64_t n_adapters, max_rank;
    const lora_adapter *adapters;
    const int32_t *row_slot;
} step_lora;

/* y (M, N) += each adapter row's update of matrix m at `layer`, output columns [n0, n1); t: a
 * scratch of max_rank floats. Every caller computes a row the same way (lora.c). */
static inline void lora_cols(const step_lora *L, int64_t layer, int m, const float *x, int64_t K, float *y, int64_t N,
                             int64_t M, int64_t n0, int64_t n1, float *t) {
    for (int64_t i = 0; i < M; i++) {
        const int32_t s = L->row_slot[i];
        if (s < 0) continue;
        const lora_adapter *ad = L->adapters + s;
        const int64_t r = ad->ranks[layer * 4 + m];
        if (!r) continue;
        lora_shrink(x + i * K, K, ad->ab[(layer * 4 + m) * 2], r, t);
        lora_expand(t, r, ad->ab[(layer * 4 + m) * 2 + 1], N, y + i * N, n0, n1);
    }
}

/* lora_cols over every column, the rows split between nt threads (the per-op schedule). */
static inline int lora_all(const step_lora *L, int64_t layer, int m, const float *x, int64_t K, float *y, int64_t N,
                           int64_t M, int nt) {
    if (!L) return 0;
    int failed = 0;
#pragma omp parallel num_threads(nt < 1 ? 1 : nt) reduction(| : failed)
    {
        float *t = malloc(sizeof(float) * (size_t)(L->max_rank > 0 ? L->max_rank : 1));
        if (!t) failed = 1;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < M; i++) {
            const step_lora one = {L->n_adapters, L->max_rank, L->adapters, L->row_slot + i};
            if (t) lora_cols(&one, layer, m, x + i * K, K, y + i * N, N, 1, 0, N, t);
        }
        free(t);
    }
    return failed ? -1 : 0;
}
#endif /* PDSERVE_STEP_LORA_H */
