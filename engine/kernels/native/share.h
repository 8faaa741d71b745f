/* share.h - how a matmul's column blocks are shared among the threads of its team
 *
 * A static split (thread t takes blocks [B t / T, B (t + 1) / T)) holds every thread at the
 * region's end while one of them is off its core: on a 2-core host the router, the load
 * generator and a peer worker take turns on both cores, so a team of two loses each such
 * turn twice. Here the blocks go in chunks, about CHUNKS_PER_THREAD a thread, each taken by
 * whichever thread is free: a thread away for a while leaves its chunks to the others. A
 * column block's arithmetic is the same whoever runs it, so y is bitwise the static split's. */
#ifndef PDSERVE_SHARE_H
#define PDSERVE_SHARE_H
#include <stdint.h>

#define CHUNKS_PER_THREAD 4

/* Column blocks per chunk for `blocks` blocks over T threads: even (the 512-bit tiles take
 * blocks in pairs), at least 2. */
static inline int64_t share_chunk(int64_t blocks, int T) {
    const int64_t n = (int64_t)T * CHUNKS_PER_THREAD, per = (blocks + n - 1) / n;
    return per < 2 ? 2 : (per + 1) & ~(int64_t)1;
}

/* Inside a parallel region: run(c0, c1) over chunks of [0, blocks) as threads come free
 * (with the `omp for`'s barrier at its end). */
#define SHARE_COLUMNS(blocks, run)                                                    \
    do {                                                                              \
        const int64_t share_b_ = (blocks);                                            \
        const int64_t share_c_ = share_chunk(share_b_, omp_get_num_threads());        \
        _Pragma("omp for schedule(dynamic, 1)")                                       \
        for (int64_t share_i_ = 0; share_i_ < (share_b_ + share_c_ - 1) / share_c_; share_i_++) { \
            const int64_t c0 = share_i_ * share_c_;                                   \
            const int64_t c1 = c0 + share_c_ < share_b_ ? c0 + share_c_ : share_b_;   \
            run;                                                                      \
        }                                                                             \
    } while (0)
#endif /* PDSERVE_SHARE_H */
