"""A group's collectives over one shared-memory segment: every rank of a tensor-parallel group
is a process on rank 0's host (engine/parallel/tp.py starts them), and gloo's loopback TCP
costs more than the work between two collectives. On 2 cores of a Xeon (family 6, model 207)
an all-reduce of one decode row took 0.72 ms through gloo between two processes and 2.6 ms
among three, 42 and 155 us here (bench/experiments/collectives.py); a decode step does two a
layer.

The segment holds, per rank, a header line (its sequence number, its sleepers' count and its
pid) and two data slots of `SLOT_BYTES`, used by operations of even and odd numbers in turn.
An operation: each rank writes its part into its slot, publishes the operation's number, and
waits until every rank has published it (engine/kernels/native/shm.c: a short spin, then a
futex); then it reads the slots it needs. Every operation is a barrier, so a rank can write
a slot again two operations later only once every rank has read it. Parts larger than a slot
move in as many operations as they need.

Waits never trust a peer blindly: every `SLICE_NS` the waiting rank checks that each peer's
process is alive (a rank killed mid-step is seen within that slice, as gloo saw a closed
socket), and a wait within a step ends at the group's timeout. A rank waiting for rank 0's
next command waits as long as rank 0 lives: an idle group neither spins nor times out.

The segment is a file in /dev/shm, created with the owner's permissions alone and a random
name that rank 0 sends sealed to the others; rank 0 unlinks it as soon as every rank has it
mapped, or the group failed to form (a rank dead or past the timeout before it mapped it), so
nothing is left however the processes end. Where it cannot be made (no /dev/shm,
too little room in it, no native kernels), the group keeps to gloo.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import time

import numpy as np
import torch

from pdserve.engine.kernels.native import NativeKernelUnavailable as Unavailable

_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mmap.restype, _LIBC.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                             ctypes.c_int, ctypes.c_int, ctypes.c_long]
_LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]

SLOT_BYTES = 1 << 20  # a decode row is 2-4 KB, a 512-token prompt chunk 1.2 MB (two operations)
LINE = 64  # a rank's header line (its own cache line): seq (int32), sleepers (int32), pid (int64)
# spin this long before sleeping: peers are usually microseconds behind. A group with more ranks than
# the host's CPUs spins less, since a spinning rank holds the CPU a peer needs (TP=3 on 2 cores: a
# decode step 45 ms spinning 5 us or 50 us, 66 ms spinning 300 us)
SPIN_NS, SPIN_CROWDED_NS = 50_000, 5_000
SLICE_NS = 50_000_000  # how often a waiting rank looks at its peers' processes


class PeerGone(RuntimeError):
    """A peer's process exited, or a wait passed the group's timeout."""


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a killed child not yet reaped is a zombie: gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


_lib = None


def _bound():
    """The native library with shm.c's functions bound (raises Unavailable without it)."""
    global _lib
    if _lib is not None:
        return _lib
    from pdserve.engine.kernels.native import load

    lib = load()
    p, i64, c_int, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int32
    lib.shm_publish.argtypes, lib.shm_publish.restype = [p, i64, c_int, i32], None
    lib.shm_wait.argtypes, lib.shm_wait.restype = [p, i64, c_int, i32, i64, i64], c_int
    _lib = lib
    return lib


def available() -> None:
    """Raises Unavailable where the native library (shm.c's waits) does not build here."""
    _bound()


def segment_bytes(world: int) -> int:
    return (world + 1) * LINE + 2 * world * SLOT_BYTES  # a line a rank, the doorbell's, the slots


def _i32(n: int) -> int:
    """A sequence number as the signed 32-bit word shm.c compares (numbers wrap at 2**32)."""
    n &= 0xFFFFFFFF
    return n - (1 << 32) if n >= 1 << 31 else n


def create(world: int) -> str:
    """Rank 0: a new segment's path (mode 0600, every byte reserved: a full /dev/shm fails here,
    not as a SIGBUS mid-step). Raises OSError where it cannot be made."""
    path = f"/dev/shm/pdserve-tp-{os.urandom(12).hex()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, segment_bytes(world))
    except OSError:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    return path


class ShmGroup:
    """This rank's view of the segment at `path` (see the module's docstring)."""

    def __init__(self, path: str, rank: int, world: int, timeout_s: float):
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self._lib = _bound()
        fd = os.open(path, os.O_RDWR)
        try:
            if os.fstat(fd).st_uid != os.getuid() or os.fstat(fd).st_size != segment_bytes(world):
                raise OSError(f"{path} is not this group's segment")
            self._size = segment_bytes(world)
            # mapped through libc, not the mmap module: a tensor over an mmap object pins its
            # buffer, and the mapping could never be closed before the process ends
            addr = _LIBC.mmap(None, self._size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mapping {path} failed")
        finally:
            os.close(fd)
        self._addr = addr
        self._bytes = torch.from_numpy(np.ctypeslib.as_array((ctypes.c_uint8 * self._size).from_address(addr)))
        self._words = addr
        head = self._bytes[:world * LINE].view(torch.int64).view(world, LINE // 8)
        self._pids = head[:, 1]
        self._pids[rank] = os.getpid()
        self.gen = 0
        self.spin_ns = SPIN_NS if world <= len(os.sched_getaffinity(0)) else SPIN_CROWDED_NS

    def _start(self, gen: int, rank: int) -> int:
        return (self.world + 1) * LINE + ((gen & 1) * self.world + rank) * SLOT_BYTES

    def slot(self, gen: int, rank: int) -> torch.Tensor:
        start = self._start(gen, rank)
        return self._bytes[start:start + SLOT_BYTES]

    def _step(self, deadline: bool = True) -> int:
        """Publish this rank's part of the next operation and wait for every rank's: its number."""
        gen = self.gen = (self.gen + 1) & 0xFFFFFFFF
        self._lib.shm_publish(self._words, LINE // 4, self.rank, _i32(gen))
        self._wait(self._words, self.world, gen, deadline)
        return gen

    def ring(self, count: int) -> None:
        """Rank 0 of a pipeline: it has posted `count` messages (through gloo) in all."""
        self._lib.shm_publish(self._words + self.world * LINE, LINE // 4, 0, _i32(count))

    def wait_rung(self, count: int) -> None:
        """Another rank of a pipeline: wait, as long as rank 0 lives, until rank 0 has posted
        `count` messages (gloo's receive would end at the group's timeout in an idle pool)."""
        self._wait(self._words + self.world * LINE, 1, count, deadline=False)

    def _wait(self, words: int, n: int, gen: int, deadline: bool) -> None:
        """Until the `n` ranks' numbers at `words` reach `gen`; PeerGone if a peer exits first,
        or at the group's timeout (`deadline`)."""
        end = time.monotonic() + self.timeout_s if deadline else float("inf")
        while not self._lib.shm_wait(words, LINE // 4, n, _i32(gen), self.spin_ns, SLICE_NS):
            # a rank not yet attached (pid 0) is waited for, up to the timeout
            gone = [r for r, pid in enumerate(self._pids.tolist()) if pid and r != self.rank and not _alive(pid)]
            if gone:
                raise PeerGone(f"rank(s) {gone} of the group exited")
            if time.monotonic() > end:
                raise PeerGone(f"no answer from the group within {self.timeout_s:.0f} s")

    def _next_slot(self) -> torch.Tensor:
        return self.slot(self.gen + 1, self.rank)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """`x` (contiguous) summed over the ranks in place, in rank order on every rank, so every
        rank holds the same bits."""
        flat = x.view(-1).view(torch.uint8)
        for lo in range(0, flat.numel(), SLOT_BYTES):
            n = min(SLOT_BYTES, flat.numel() - lo)
            self._next_slot()[:n].copy_(flat[lo:lo + n])
            gen = self._step()
            part = [self.slot(gen, r)[:n].view(x.dtype) for r in range(self.world)]
            out = flat[lo:lo + n].view(x.dtype)
            out.copy_(part[0])
            for p in part[1:]:
                out.add_(p)
        return x

    def gather(self, t: torch.Tensor, outs: list[torch.Tensor] | None, nbytes: list[int]) -> None:
        """Every rank's contiguous `t` into rank 0's `outs[r]` (nbytes[r]: rank r's size, known
        to every rank)."""
        mine, most = t.view(-1).view(torch.uint8), max(nbytes)
        for lo in range(0, most, SLOT_BYTES):
            n = max(0, min(SLOT_BYTES, mine.numel() - lo))
            self._next_slot()[:n].copy_(mine[lo:lo + n])
            gen = self._step()
            if self.rank == 0:
                for r, out in enumerate(outs):
                    m = max(0, min(SLOT_BYTES, nbytes[r] - lo))
                    out.view(-1).view(torch.uint8)[lo:lo + m].copy_(self.slot(gen, r)[:m])

    def send(self, data: bytes) -> None:
        """Rank 0: `data` to every other rank (`receive`)."""
        head = len(data).to_bytes(8, "little")
        body = memoryview(head + data)
        for lo in range(0, len(body), SLOT_BYTES):
            chunk = body[lo:lo + SLOT_BYTES]
            ctypes.memmove(self._addr + self._start(self.gen + 1, self.rank), bytes(chunk), len(chunk))
            self._step()

    def receive(self, limit: int) -> bytes:
        """Another rank: rank 0's next `send` (waited for as long as rank 0 lives). Raises
        ValueError for a length over `limit` before reading more."""
        gen = self._step(deadline=False)
        first = self.slot(gen, 0)
        n = int.from_bytes(first[:8].numpy().tobytes(), "little")
        if not 0 < n <= limit:
            raise ValueError(f"a message of {n} bytes")
        out = bytearray(n)
        got = min(n, SLOT_BYTES - 8)
        out[:got] = first[8:8 + got].numpy().tobytes()
        while got < n:
            gen = self._step()
            m = min(SLOT_BYTES, n - got)
            out[got:got + m] = self.slot(gen, 0)[:m].numpy().tobytes()
            got += m
        return bytes(out)

    def close(self) -> None:
        if self._addr is not None:
            self._bytes = self._pids = None  # no view of the segment may outlive it
            _LIBC.munmap(ctypes.c_void_p(self._addr), ctypes.c_size_t(self._size))
            self._addr = None
