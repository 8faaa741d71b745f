/* The waits of a group's collectives over shared memory (engine/parallel/shm.py): the ranks
 * of a tensor-parallel group share a host, and gloo's loopback TCP took 0.72 ms for an
 * all-reduce of one decode row between two processes on two cores, 2.6 ms among three.
 *
 * Each rank owns two 32-bit words in the shared header, `stride` words apart: its sequence
 * number (the last operation whose data it has written) and the count of ranks sleeping on
 * that number. A rank publishes an operation by storing its number; a rank that needs every
 * rank's data of operation `gen` spins a short while (the others are usually a few
 * microseconds behind), then sleeps on the futex of the first rank not there yet, so an idle
 * group costs no CPU. Sequence numbers wrap: "at or past" is a signed difference. */
#include <limits.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>
#include <linux/futex.h>
#include <sys/syscall.h>

static int64_t shm_now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static void shm_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static int shm_reached(int32_t *seq, int32_t gen) {
    return (int32_t)(__atomic_load_n(seq, __ATOMIC_ACQUIRE) - gen) >= 0;
}

/* Rank `rank` has written its data of operation `gen`: store the number (after the data,
 * which the caller wrote before this call) and wake whoever sleeps on it. */
void shm_publish(int32_t *words, int64_t stride, int rank, int32_t gen) {
    int32_t *seq = words + rank * stride;
    __atomic_store_n(seq, gen, __ATOMIC_SEQ_CST);
    /* seq_cst on both sides: a sleeper counted after this load sees the new number first */
    if (__atomic_load_n(seq + 1, __ATOMIC_SEQ_CST) > 0)
        syscall(SYS_futex, seq, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* 1 once every rank of [0, world) has published `gen` or later, 0 when `slice_ns` passed
 * first (the caller checks its peers are alive and its deadline, then waits again). Spins for
 * `spin_ns`, then sleeps. */
int shm_wait(int32_t *words, int64_t stride, int world, int32_t gen, int64_t spin_ns, int64_t slice_ns) {
    int64_t start = shm_now_ns();
    int r = 0;
    for (;;) {
        while (r < world && shm_reached(words + r * stride, gen))
            r++;
        if (r == world)
            return 1;
        int64_t t = shm_now_ns() - start;
        if (t < spin_ns) {
            for (int i = 0; i < 16; i++)
                shm_relax();
            continue;
        }
        if (t >= slice_ns)
            return 0;
        int32_t *seq = words + r * stride;
        __atomic_add_fetch(seq + 1, 1, __ATOMIC_SEQ_CST);
        int32_t seen = __atomic_load_n(seq, __ATOMIC_SEQ_CST);
        if ((int32_t)(seen - gen) < 0) {
            int64_t left = slice_ns - t;
            struct timespec ts = {(time_t)(left / 1000000000LL), (long)(left % 1000000000LL)};
            syscall(SYS_futex, seq, FUTEX_WAIT, seen, &ts, NULL, 0);
        }
        __atomic_sub_fetch(seq + 1, 1, __ATOMIC_SEQ_CST);
    }
}
