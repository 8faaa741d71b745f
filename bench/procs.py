"""The process tree of a server a benchmark started, and what its processes leave behind.

vLLM's CPU build loads Intel's OpenMP runtime (libiomp5), which registers each process in a
file /dev/shm/__KMP_REGISTERED_LIB_<pid>_<uid> and removes it at a clean exit only: the engine
processes a server's SIGINT ends leave theirs. `leftovers_of(pids)` finds those of processes
that have ended; `clear_leftovers` removes them. Only the PIDs given (a tree this process
started) are touched."""
from __future__ import annotations

from pathlib import Path

SHM = Path("/dev/shm")
KMP_PREFIX = "__KMP_REGISTERED_LIB_"


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (its children, theirs, ...), from /proc."""
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = [int(c) for c in (task / "children").read_text().split()]
            except (OSError, ValueError):
                continue
            for c in kids:
                if c not in out:
                    out.add(c)
                    todo.append(c)
    return out


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, ended but not yet reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:].split(" ", 1)[0] != "Z"


def leftovers_of(pids: set[int], shm: Path = SHM) -> list[Path]:
    """The libiomp registration files of the processes `pids` that have ended."""
    return sorted(f for pid in pids if not _alive(pid) for f in shm.glob(f"{KMP_PREFIX}{pid}_*"))


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
