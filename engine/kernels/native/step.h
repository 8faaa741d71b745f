/* step.h - what the decode step's two files share: the layer loop, a region per op and the rows
 * split between threads (step.c), and the whole step on one OpenMP team (step_team.c). */
#ifndef PDSERVE_STEP_H
#define PDSERVE_STEP_H
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_thread_num(void) { return 0; }
static inline int omp_get_num_threads(void) { return 1; }
#endif
#include "kvformat.h"

#define STEP_PTRS 22
#define STEP_BYTES 14 /* the first of the byte weights' pointers */
#define STEP_HALF 18  /* the first of the fp16 scales' pointers */
#define STEP_STOPPED (-4) /* decode_step_llama stopped at a layer's end: nothing it computed counts */

int w4a8_matmul(const float *x, const uint8_t *wq, const float *dw, const float *mw, float *y, int64_t M, int64_t N,
                int64_t K, int nt);
void silu_mul_f32(const float *gu, float *out, int64_t T, int64_t I, int nthreads);
void rope_f32(float *x, int64_t T, int64_t stride, int heads, int hd, const float *cos_t, const float *sin_t,
              const int64_t *positions, int nthreads);
void add_rms_norm_f32(float *h, const float *delta, const float *w, float *out, int64_t T, int64_t D, float eps,
                      int nthreads);
int paged_decode_attention_f32(const float *q, const void *kc, const void *vc, const int64_t *tables,
                               const int64_t *lens, const int64_t *skips, float *out, int B, int H, int KVH, int D,
                               int bs, int max_blocks, float scale, int nthreads, int kv_fmt);

int bf16_prompt_attention(const float *q, const void *kc, const void *vc, const int64_t *tables, const int64_t *lens,
                          float *out, int B, int H, int KVH, int D, int bs, int max_blocks, float scale, int nthreads,
                          int fmt);
int paged_attention_item(const float *q, const void *kc, const void *vc, const int64_t *tables, const int64_t *lens,
                         const int64_t *skips, float *out, int w, int H, int KVH, int D, int bs, int max_blocks,
                         float scale, int kv_fmt);
int paged_attention_row(const float *q, const void *kc, const void *vc, const int64_t *tables, const int64_t *lens,
                        const int64_t *skips, float *out, int b, int H, int KVH, int D, int bs, int max_blocks,
                        float scale, int kv_fmt);

#include "step_lora.h"

/* w4a8n.c: Q4_1 x int8 over nibble-packed weights (bitwise w4a8_matmul's result) */
int w4a8n_matmul(const float *x, const uint8_t *wn, const float *dw, const float *mw, float *y, int64_t M, int64_t N,
                 int64_t K, int nt, int hs);
#ifdef __AVX2__
#include <immintrin.h>
void w4a8_quantize_row(const float *x, int64_t K, int8_t *q, float *d, float *s, int row);
void w4a8n_columns(const int8_t *xq, const float *dx, const float *sx, const uint8_t *wn, const float *dw,
                   const float *mw, float *y, int64_t M, int64_t N, int64_t K, int64_t c0, int64_t c1);
void w4a8n_columns_h(const int8_t *xq, const float *dx, const float *sx, const uint8_t *wn, const float *dw,
                     const float *mw, float *y, int64_t M, int64_t N, int64_t K, int64_t c0, int64_t c1);
#endif

/* The model's shape, as engine/kernels/native/step.py fills it (field order matters). */
typedef struct {
    int64_t layers, hidden, heads, kv_heads, head_dim, inter, block_size, max_blocks;
    float eps, scale;
    int64_t max_positions, num_slots; /* the cos/sin tables' rows, the cache's slots: the inputs' bounds */
    int64_t kv_fmt;                   /* the cache's format (kvformat.h): KV_F32, KV_BF16, KV_INT8, KV_FP8 */
    int64_t byte_rows;                /* a step of more rows reads the byte weights (where present) */
    int64_t n_bf16;                   /* ranges of prompt rows that attend in bf16 vectors (bf16_attention.c) */
    const int64_t *bf16_ranges;       /* n_bf16 (start, end) pairs, ascending */
} step_dims;

/* The step's scratch, one allocation: each buffer is (M, width) fp32. */
typedef struct {
    float *x, *qkv, *q, *att, *a, *gu, *act, *delta;
} step_bufs;

/* step.c: a new K or V row into its cache slot; whether the step stops at this layer's end; the
 * scratch for M rows (one allocation, returned for free; NULL without memory); one layer of M rows */
void step_put_kv(void *cache, int64_t slot, int64_t kh, int64_t nh, const float *x, const step_dims *d);
int step_stop_now(const int32_t *stop, int32_t threshold);
float *step_alloc_bufs(step_bufs *b, const step_dims *d, int64_t M);
/* A step's caller at its pause points (decode_step_llama): layer li's end (where 0), inside it
 * after the attention (1) and after the MLP's first matmul (2). Negative stops the step there;
 * positive is the threads the step's next ops run on (a peer took its cores back, or lent its
 * own: engine/parallel/cores.py); 0 leaves them as they are. */
typedef int (*step_hook)(int64_t li, int64_t where);
int step_layer(const step_dims *d, void *const *w, void *kc, void *vc, float *h, const float *delta, step_bufs *b,
               const int64_t *positions, const float *cos_t, const float *sin_t, const int64_t *slots,
               const int64_t *tables, const int64_t *lens, int64_t M, int nt, const step_lora *L, int64_t li,
               step_hook hook);

/* step_split.c: decode_step_llama's rows split between the threads (one_region 2; 3 `skewed`) */
int step_split(const step_dims *d, void *const *weights, void *const *kv, const float *final_w, float *h, float *out,
               const int64_t *positions, const float *cos_t, const float *sin_t, const int64_t *slots,
               const int64_t *tables, const int64_t *lens, int64_t M, int nt, const step_lora *L,
               const int32_t *stop, int32_t threshold, int skewed);

#ifdef __AVX2__
/* step_team.c: decode_step_llama's work on one team */
int step_team(const step_dims *d, void *const *weights, void *const *kv, const float *final_w, float *h, float *out,
              step_bufs *s, const int64_t *positions, const float *cos_t, const float *sin_t, const int64_t *slots,
              const int64_t *tables, const int64_t *lens, int64_t M, int nt, const step_lora *L, const int32_t *stop,
              int32_t threshold);
#endif
#endif /* PDSERVE_STEP_H */
