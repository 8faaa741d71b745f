"""One OpenMP thread team per process: the engine thread's.

torch's CPU kernels (and ours, engine/kernels/native) run on libgomp, which keeps one team of worker
threads per thread that opens a parallel region, for as long as that thread lives. Workers of
a team spin between regions, but only while the process's libgomp threads fit the cores: one
thread more, and every worker sleeps on a futex after ~100 spins and is woken per region.
On 2 cores, a model loaded on the main thread (one team) and then stepped on the engine thread
(a second team) decoded one stream at 16 ms per token instead of 8 (measured, int8).

So a worker process loads its model on a thread that exits (`in_fresh_thread`: its team goes
with it), and the threads that only serve (the asyncio loop) run their tensor ops without a
team (`single_threaded_here`): the engine thread's team is then the only one.
"""
from __future__ import annotations

import ctypes
import threading
from typing import Callable, TypeVar

T = TypeVar("T")


def in_fresh_thread(fn: Callable[[], T], name: str = "pdserve-load") -> T:
    """Run `fn()` on a new thread, wait for it, and return its result (or raise its exception).
    The OpenMP team `fn` opened leaves with the thread."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            box["error"] = e

    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def _libgomp() -> ctypes.CDLL | None:
    import torch  # noqa: F401 - torch loads its libgomp first; this resolves to the same copy

    try:
        return ctypes.CDLL("libgomp.so.1")
    except OSError:
        return None  # another OpenMP runtime (or none): nothing to limit


def single_threaded_here() -> bool:
    """Make parallel regions opened by the calling thread run on it alone (OpenMP's per-thread
    `nthreads` setting; torch's global thread count is untouched). Returns False where torch's
    OpenMP runtime is not libgomp, which is left as it is."""
    import torch

    gomp = _libgomp()
    if gomp is None:
        return False
    # torch sets each thread's OpenMP count to its global one at that thread's first parallel
    # call (lazily, once): have that happen now, or it would undo the setting below
    torch.get_num_threads()
    gomp.omp_set_num_threads(1)
    return True


def openmp_threads_here() -> int:
    """How many threads a parallel region opened by the calling thread would use."""
    gomp = _libgomp()
    return int(gomp.omp_get_max_threads()) if gomp is not None else 1
