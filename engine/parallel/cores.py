"""Cores lent between the worker processes of one machine.

A disaggregated cluster on one host gives each worker its own cores (one each on a 2-core
machine), so a lone request's prefill runs on one core while the decode worker's sits idle,
and its decode on one core while the prefill worker's does. Two threads for every worker
would cost more than it gains: when both are busy, a thread team whose thread waits for a
core holds up every parallel region of the step (measured on 2 cores: 32 streams 48.7 ->
33.6 tok/s).

So each worker steps with its own threads while another worker on the host is busy, and with
its own plus every idle peer's threads while none is. "Busy" is an exclusive `flock` a worker
holds on its file in a directory shared by the cluster's workers on this host, from its first
step with work until it has none; a peer that cannot take that lock for a moment knows the
owner is busy. A dead worker's lock goes with its process. The file holds the owner's own
thread count, so a borrower takes only what idle peers own.
"""
from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

CHECK_INTERVAL_S = 0.02  # peers are looked at most this often (two syscalls per peer)


class CoreShare:
    def __init__(self, directory: str | Path, name: str, own_threads: int,
                 max_threads: int | None = None, set_threads=None):
        """`directory`: shared by the workers of one cluster on one host; `name`: this worker's
        (its file); `own_threads`: what it runs with while a peer is busy; `max_threads`: the
        most it may use (default: the CPUs this process may run on); `set_threads(n)`: applies a
        thread count (default torch.set_num_threads), on the engine thread."""
        if own_threads < 1:
            raise ValueError(f"own_threads must be >= 1, got {own_threads}")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / f"{name}.busy"
        self.own = own_threads
        self.max = max_threads or len(os.sched_getaffinity(0))
        self._set = set_threads or _torch_set_threads
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, str(own_threads).encode(), 0)
        self.busy = False
        self.threads = own_threads
        self._checked = 0.0

    def step_threads(self) -> int:
        """Called before each step with work: mark this worker busy and return (and apply) the
        thread count for the step."""
        if not self.busy:
            fcntl.flock(self._fd, fcntl.LOCK_EX)  # a peer's probe holds it for microseconds at most
            self.busy = True
        now = time.monotonic()
        if now - self._checked >= CHECK_INTERVAL_S:
            self._checked = now
            want = min(self.max, self.own + self.idle_peer_threads())
            if want != self.threads:
                self._set(want)
                self.threads = want
        return self.threads

    def idle(self) -> None:
        """This worker has nothing to step: its cores are free for its peers."""
        if self.busy:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            self.busy = False

    def idle_peer_threads(self) -> int:
        """Threads owned by peers that are idle now; 0 as soon as one peer is busy (a busy peer
        needs its cores, and lending to one borrower while another is busy oversubscribes)."""
        total = 0
        for path in self.dir.glob("*.busy"):
            if path == self.path:
                continue
            try:
                fd = os.open(path, os.O_RDWR)
            except OSError:
                continue  # removed as we looked
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return 0
                fcntl.flock(fd, fcntl.LOCK_UN)
                total += _owned(fd)
            finally:
                os.close(fd)
        return total

    def close(self) -> None:
        if self._fd >= 0:
            self.idle()
            os.close(self._fd)
            self._fd = -1
            try:
                self.path.unlink()
            except OSError:
                pass


def _owned(fd: int) -> int:
    try:
        return max(int(os.pread(fd, 16, 0) or b"0"), 0)
    except ValueError:
        return 0


def _torch_set_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)
