/* step_split.c - step.c's split schedule (decode_step_llama's one_region 2): a decode step's
 * rows split between the threads, each part through every layer on one thread alone, with the
 * kernels called single-threaded, so the parts meet only at the step's end. A team splitting
 * each op waits at every op's end for a thread the OS gave away (32 rows, 200 tokens each, in
 * one process beside a process busy 20% of a core: 679-714 split against 522-626 tok/s).
 *
 * The parts are balanced by their work (a row's matmuls, as SPLIT_ROW_KEYS keys of its context,
 * plus its context), and rebalanced while the step runs: a thread that has finished its rows
 * takes the later half of the rows of the thread with the most work left, from that thread's
 * next layer on (a task: rows [lo, end) from a layer to the last). A thread the OS delays so
 * delays the step by about half its absence, not all of it. A row's state between layers is
 * the shared residual stream h and the MLP output its thread holds (its `delta`), which the
 * taker copies once the owner has finished the layer it is in. Each thread reads every weight
 * of the layers it runs; a row's result is its own whatever thread computes it (the kernels are
 * batch invariant).
 *
 * The hand-over without locks: each thread's `state` word holds its task's generation, the
 * layer it is in (+1) and its rows' end. The owner claims each layer with a compare-and-swap
 * that keeps the end; a taker shortens the end with a compare-and-swap that keeps the layer, so
 * exactly one of them wins each race and the owner runs the new end from its next layer on.
 * The owner publishes `done` (its last finished layer) before it claims the next one.
 */
#include <sched.h>
#include "step.h"
#ifdef __AVX2__
#include <immintrin.h>
#define SPIN_PAUSE() _mm_pause()
#else
#define SPIN_PAUSE() ((void)0)
#endif

#define SPLIT_ROW_KEYS 330
#define SPLIT_THREADS 64
#define END_BITS 0xffffffffull
#define LAYER_OF(s) ((int64_t)(((s) >> 32) & 0xffff) - 1) /* the layer in progress; -1 before the first */
#define PACK(gen, layer, end) ((uint64_t)(gen) << 48 | (uint64_t)((layer) + 1) << 32 | (uint64_t)(end))

static int64_t taken; /* rows handed over so far (tests read it: decode_step_taken) */

int64_t decode_step_taken(void) { return __atomic_load_n(&taken, __ATOMIC_RELAXED); }

typedef struct {
    _Alignas(64) uint64_t state; /* PACK(generation, layer in progress, end of the rows) */
    int64_t lo;                  /* the task's first row; written before the state that publishes it */
    int64_t done;                /* the last layer the task's rows have finished (-1: none) */
    float *delta;                /* the owner's MLP outputs: row r at (r - lo) * hidden */
} split_task;

typedef struct {
    const step_dims *d;
    void *const *weights, *const *kv;
    float *h;
    const int64_t *positions, *slots, *tables, *lens;
    const float *cos_t, *sin_t;
    const step_lora *L;
    const int32_t *stop;
    int32_t threshold;
    split_task *tasks;
    int nt;
    int abort; /* a thread failed or stopped: no more taking, no more waiting */
} split_ctx;

/* The end of the rows for layer i of thread t's task, the layer claimed. */
static int64_t claim(split_task *t, int64_t i) {
    uint64_t s = __atomic_load_n(&t->state, __ATOMIC_ACQUIRE);
    while (!__atomic_compare_exchange_n(&t->state, &s, PACK(s >> 48, i, s & END_BITS), 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE)) {
    }
    return (int64_t)(s & END_BITS);
}

/* Thread `me`'s task: rows from lo, layers from `from`, its end shortened by takers meanwhile.
 * Returns 0, -1 (a layer failed) or STEP_STOPPED; the final norm of its rows into `out`. */
static int run_task(split_ctx *c, int me, step_bufs *b, int64_t from, const float *final_w, float *out) {
    const step_dims *d = c->d;
    split_task *t = &c->tasks[me];
    const int64_t H = d->hidden, mb = d->max_blocks, lo = __atomic_load_n(&t->lo, __ATOMIC_RELAXED);
    const step_lora *L = c->L;
    const step_lora sub = {L ? L->n_adapters : 0, L ? L->max_rank : 0, L ? L->adapters : NULL,
                           L ? L->row_slot + lo : NULL};
    int64_t end = (int64_t)(__atomic_load_n(&t->state, __ATOMIC_ACQUIRE) & END_BITS);
    int rc = 0;
    for (int64_t i = from; i < d->layers && !rc && end > lo; i++) { /* a first task may be empty */
        end = claim(t, i);
        rc = step_layer(d, c->weights + i * STEP_PTRS, c->kv[2 * i], c->kv[2 * i + 1], c->h + lo * H,
                        i ? b->delta : NULL, b, c->positions + lo, c->cos_t, c->sin_t, c->slots + lo,
                        c->tables + lo * mb, c->lens + lo, end - lo, 1, L ? &sub : NULL, i, NULL);
        __atomic_store_n(&t->done, i, __ATOMIC_RELEASE);
        if (!rc && i + 1 < d->layers && step_stop_now(c->stop, c->threshold)) rc = STEP_STOPPED;
    }
    uint64_t s = __atomic_load_n(&t->state, __ATOMIC_ACQUIRE); /* finished: nothing left to take */
    while (!__atomic_compare_exchange_n(&t->state, &s, PACK(s >> 48, d->layers, s & END_BITS), 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE)) {
    }
    if (rc) {
        __atomic_store_n(&c->abort, 1, __ATOMIC_RELEASE);
        return rc;
    }
    if (end > lo)
        add_rms_norm_f32(c->h + lo * H, b->delta, final_w, out + lo * H, end - lo, H, d->eps, 1);
    return 0;
}

/* Thread `me`, its rows done: take the later half of the rows of the thread with the most work
 * left (at least two rows and a layer after the one it is in), copy their MLP outputs once that
 * layer is finished, and publish them as its task. Returns the task's first layer, or -1 when
 * there is nothing worth taking. */
static int64_t take(split_ctx *c, int me, step_bufs *b) {
    const int64_t layers = c->d->layers, H = c->d->hidden;
    /* once the step is stopping no rows change hands: taken rows run at least their next layer */
    while (!__atomic_load_n(&c->abort, __ATOMIC_ACQUIRE) && !step_stop_now(c->stop, c->threshold)) {
        int v = -1;
        int64_t most = 0, vlo = 0;
        uint64_t vs = 0;
        for (int u = 0; u < c->nt; u++) {
            const uint64_t s = __atomic_load_n(&c->tasks[u].state, __ATOMIC_ACQUIRE);
            const int64_t ulo = __atomic_load_n(&c->tasks[u].lo, __ATOMIC_RELAXED), rows = (int64_t)(s & END_BITS) - ulo, left = layers - 1 - LAYER_OF(s);
            if (u != me && rows >= 2 && left >= 1 && rows * left > most) v = u, most = rows * left, vlo = ulo, vs = s;
        }
        if (v < 0) return -1;
        const int64_t cur = LAYER_OF(vs), end = (int64_t)(vs & END_BITS), mid = vlo + (end - vlo) / 2;
        if (!__atomic_compare_exchange_n(&c->tasks[v].state, &vs, PACK(vs >> 48, cur, mid), 0, __ATOMIC_ACQ_REL,
                                         __ATOMIC_ACQUIRE))
            continue; /* the owner claimed its next layer, or another taker came first: look again */
        for (int spins = 0; cur >= 0 && __atomic_load_n(&c->tasks[v].done, __ATOMIC_ACQUIRE) < cur; spins++) {
            if (__atomic_load_n(&c->abort, __ATOMIC_ACQUIRE)) return -1; /* failed or stopped: nothing counts */
            if (spins < 256) SPIN_PAUSE();
            else sched_yield(); /* the owner may be waiting for this very core */
        }
        if (cur >= 0)
            memcpy(b->delta, c->tasks[v].delta + (mid - vlo) * H, sizeof(float) * (size_t)((end - mid) * H));
        split_task *t = &c->tasks[me];
        __atomic_store_n(&t->lo, mid, __ATOMIC_RELAXED);
        __atomic_store_n(&t->done, cur, __ATOMIC_RELAXED);
        const uint64_t s = __atomic_load_n(&t->state, __ATOMIC_RELAXED);
        __atomic_store_n(&t->state, PACK((s >> 48) + 1, cur, end), __ATOMIC_RELEASE);
        __atomic_fetch_add(&taken, end - mid, __ATOMIC_RELAXED);
        return cur + 1;
    }
    return -1;
}

/* Thread t's first task: rows in proportion to their work (above); `skewed`: every row the
 * first thread's (the others take theirs as they start: the hand-over path, for tests). */
static void first_tasks(split_task *tasks, int nt, const int64_t *lens, int64_t M, int skewed) {
    int64_t total = 0, acc = 0, t = 1;
    for (int64_t i = 0; i < M; i++) total += SPLIT_ROW_KEYS + lens[i];
    tasks[0].lo = 0;
    for (int64_t i = 0; i < M && t < nt && !skewed; i++) {
        acc += SPLIT_ROW_KEYS + lens[i];
        while (t < nt && acc * nt >= total * t) tasks[t++].lo = i + 1;
    }
    for (; t < nt; t++) tasks[t].lo = M;
    for (int u = 0; u < nt; u++) {
        const int64_t end = u + 1 < nt ? tasks[u + 1].lo : M;
        tasks[u].state = PACK(0, -1, end);
        tasks[u].done = -1;
    }
}

int step_split(const step_dims *d, void *const *weights, void *const *kv, const float *final_w, float *h, float *out,
               const int64_t *positions, const float *cos_t, const float *sin_t, const int64_t *slots,
               const int64_t *tables, const int64_t *lens, int64_t M, int nt, const step_lora *L,
               const int32_t *stop, int32_t threshold, int skewed) {
    split_task tasks[SPLIT_THREADS];
    split_ctx c = {d, weights, kv, h, positions, slots, tables, lens, cos_t, sin_t, L, stop, threshold, tasks, 0, 0};
    int failed = 0, stopped = 0;
    if (nt > SPLIT_THREADS) nt = SPLIT_THREADS;
#pragma omp parallel num_threads(nt) reduction(| : failed, stopped)
    {
        const int me = omp_get_thread_num();
#pragma omp single
        {
            c.nt = omp_get_num_threads(); /* the team OpenMP gave: every row is some thread's */
            first_tasks(tasks, c.nt, lens, M, skewed);
        }
        int64_t rows = 0;
        for (int u = 0; u < c.nt; u++) {
            const int64_t end = (int64_t)(tasks[u].state & END_BITS);
            if (end - tasks[u].lo > rows) rows = end - tasks[u].lo;
        }
        step_bufs b;
        float *base = rows > 0 ? step_alloc_bufs(&b, d, rows) : NULL;
        tasks[me].delta = base ? b.delta : NULL;
#pragma omp barrier
        if (rows > 0 && !base) {
            failed = 1;
            __atomic_store_n(&c.abort, 1, __ATOMIC_RELEASE);
        }
        for (int64_t from = 0; base && from >= 0; from = take(&c, me, &b)) {
            const int rc = run_task(&c, me, &b, from, final_w, out);
            if (rc == STEP_STOPPED) stopped = 1;
            else if (rc) failed = 1;
            if (rc) break;
        }
        free(base);
    }
    return failed ? -1 : stopped ? STEP_STOPPED : 0;
}
