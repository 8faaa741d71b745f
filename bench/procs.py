"""The process tree of a server a benchmark started, and what its processes leave behind.

vLLM's CPU build loads Intel's OpenMP runtime (libiomp5), which registers each process in a
file /dev/shm/__KMP_REGISTERED_LIB_<pid>_<uid> and removes it at a clean exit only: the engine
processes a server's SIGINT ends leave theirs. `leftovers_of(pids)` finds those of processes
that have ended; `clear_leftovers` removes them. Only the PIDs given (a tree this process
started) are touched."""
from __future__ import annotations

from pathlib import Path

from pdserve.common.proctree import alive, descendants  # noqa: F401 - bench/peers.py takes descendants here

SHM = Path("/dev/shm")
KMP_PREFIX = "__KMP_REGISTERED_LIB_"


def leftovers_of(pids: set[int], shm: Path = SHM) -> list[Path]:
    """The libiomp registration files of the processes `pids` that have ended."""
    return sorted(f for pid in pids if not alive(pid) for f in shm.glob(f"{KMP_PREFIX}{pid}_*"))


def clear_leftovers(pids: set[int], shm: Path = SHM) -> list[Path]:
    """Remove `leftovers_of(pids)`; returns what was removed."""
    gone = []
    for f in leftovers_of(pids, shm):
        try:
            f.unlink()
            gone.append(f)
        except FileNotFoundError:
            pass
    return gone
