"""One process's membership of a tensor-parallel group: the authenticated rendezvous, the
collectives and rank 0's sealed messages to the other ranks. All-reduces, gathers and rank
0's commands move through shared memory (engine/parallel/shm.py: every rank is a process on
rank 0's host) where a segment can be made, through gloo otherwise; KV scatters and a
pipeline's point-to-point messages always through gloo.

The ranks join in two steps: each rank's process says on the store that it has loaded its
slice, and once every one has (or one has exited: at once, not at a timeout) rank 0 lets the
group form; the start-up's own time limit (`JOIN_S`) is not the collectives' timeout. The
group forms on a loopback TCPStore under a key prefix derived from the group's random
secret (engine/parallel/wire.py), then every rank proves the secret before anything else
moves: another local user, who can reach the store's and the ranks' ports, can neither join
the group nor speak in it, and what rank 0 sends is decoded without unpickling.
"""
from __future__ import annotations

import hmac
import os
import sys
import time
from collections import deque
from datetime import timedelta

import torch
import torch.distributed as dist

from pdserve.common.errors import PdserveError
from pdserve.engine.parallel import shm as shm_mod
from pdserve.engine.parallel.wire import MAX_MESSAGE, PeerRefused, decode, encode, mac, seal, store_prefix, unseal



# isend's works held at once: a pipeline's rank 0 posts 3 sends a micro-batch a stage (the
# step's length and message, the residual stream) and lands each micro-batch two or three
# launches later, so a send this many back was received long ago
SENT_KEPT = 32

class RankFailed(PdserveError, RuntimeError):
    """A rank of a tensor-parallel group died or stopped answering: the group is down."""


def group_store(host: str, port: int, world: int, is_rank0: bool, timeout_s: float, secret: bytes):
    """The group's rendezvous store: a TCPStore on loopback (rank 0 hosts it; `port` 0: any
    free one), its keys under a prefix only the secret's holders know."""
    store = dist.TCPStore(host, port, world, is_rank0, timeout=timedelta(seconds=timeout_s),
                          **({"wait_for_workers": False} if is_rank0 else {}))
    return store, dist.PrefixStore(store_prefix(secret), store)


# how long the ranks' processes may take to start and load their slices: a fresh interpreter
# and a model read from a slow disk, on a loaded host (a rank that exits ends the wait at once)
JOIN_S = 600.0
JOINED = "joined"  # the key rank 0 sets once every rank has loaded


def announce_loaded(store, rank: int, join_s: float = JOIN_S) -> None:
    """A rank other than 0: say that its slice is loaded, then wait until every rank has."""
    store.set(f"loaded/{rank}", b"1")
    try:
        store.wait([JOINED], timedelta(seconds=join_s))
    except RuntimeError as e:
        raise RankFailed(f"rank 0 did not start the group within {join_s:.0f} s: {e}") from e


def await_loaded(store, procs: list, join_s: float = JOIN_S, poll_s: float = 0.05) -> None:
    """Rank 0: wait until each rank's process (procs[r - 1], a Popen) has loaded its slice,
    then let the group form. RankFailed as soon as one exits, or past `join_s`."""
    end, pending = time.monotonic() + join_s, set(range(1, len(procs) + 1))
    while pending:
        for r in sorted(pending):
            if store.check([f"loaded/{r}"]):
                pending.discard(r)
            elif procs[r - 1].poll() is not None:
                raise RankFailed(f"tensor-parallel rank {r} exited (code {procs[r - 1].returncode}) "
                                 "before it joined the group")
        if pending and time.monotonic() > end:
            raise RankFailed(f"tensor-parallel ranks {sorted(pending)} did not load within {join_s:.0f} s")
        if pending:
            time.sleep(poll_s)
    store.set(JOINED, b"1")


MESSAGES = 1  # the tag of rank 0's posted messages (activations and KV move under tag 0)


class Group:
    """This process's membership of a group: gloo collectives on a process group of its own
    (not torch's default group, so that one process can hold several, as tests do). Every
    rank proves the group's secret when the group forms, and rank 0's messages are sealed
    under it (engine/parallel/wire.py)."""

    def __init__(self, rank: int, world: int, store, timeout_s: float, secret: bytes, on_failure=None):
        """store: the rendezvous store (TCPStore; `group_store` keeps the group's keys under
        its secret); on_failure(): called once when a collective fails (rank 0 takes the
        group down). Raises PeerRefused when a rank does not prove `secret`."""
        self.rank, self.world, self.on_failure = rank, world, on_failure
        try:
            self.pg = dist.ProcessGroupGloo(store, rank, world, timedelta(seconds=timeout_s))
        except RuntimeError as e:
            raise RankFailed(f"the tensor-parallel group of {world} ranks did not form: {e}") from e
        self.allreduce_s = 0.0
        self.allreduces = 0
        self.widths: list[int] = []  # every rank's columns in gather_columns (set by attach)
        self.gather_s = 0.0  # time in gather_columns (the logits)
        self.seq = 0  # messages rank 0 sent (or this rank received): each is sealed with its number
        self.key = b""  # the session's, once every rank proved the secret
        self.posted = False  # rank 0's messages point to point, unwaited (a pipeline's: pp.attach_stage)
        self._sent: deque = deque()  # isend's works not yet waited for, with their buffers
        self.shm: shm_mod.ShmGroup | None = None
        self._authenticate(secret)
        self._attach_shm(timeout_s)

    def _attach_shm(self, timeout_s: float) -> None:
        """Rank 0 makes the segment and sends its path (sealed); every rank maps it and says so;
        rank 0 unlinks it and tells whether every rank has it: if one has not, gloo carries all."""
        path = ""
        if self.rank == 0 and self.world > 1:
            try:
                shm_mod.available()
                path = shm_mod.create(self.world)
            except (OSError, shm_mod.Unavailable) as e:
                print(f"pdserve tensor-parallel group: no shared-memory segment ({e}): its collectives go "
                      "through gloo, an all-reduce ~17x slower", file=sys.stderr, flush=True)
        try:
            mapped, view = self._map_shm(path, timeout_s)
        finally:  # a rank that never mapped it (dead, or slower than the timeout) leaves no file behind
            if self.rank == 0 and path:
                os.unlink(path)
        if self.rank == 0:
            self.broadcast(bool(path) and all(bool(m) for m in mapped))
        everyone = self.receive() if self.rank != 0 else bool(path) and all(bool(m) for m in mapped)
        if everyone:
            self.shm = view
        elif view is not None:
            view.close()

    def _map_shm(self, path: str, timeout_s: float) -> tuple[list, shm_mod.ShmGroup | None]:
        """Rank 0 sends the segment's path (sealed), every rank maps it; (whether each rank
        has it, as rank 0 gathered; this rank's view or None)."""
        if self.rank == 0 and self.world > 1:
            self.broadcast(path)
        elif self.world > 1:
            path = self.receive()
        try:
            view = shm_mod.ShmGroup(path, self.rank, self.world, timeout_s) if path else None
        except (OSError, shm_mod.Unavailable) as e:
            print(f"pdserve tensor-parallel rank {self.rank}: cannot map the group's segment ({e}): the group's "
                  "collectives go through gloo", file=sys.stderr, flush=True)
            view = None
        try:
            return self.gather(torch.tensor([view is not None], dtype=torch.uint8)), view
        except BaseException:
            if view is not None:
                view.close()
            raise

    def _authenticate(self, secret: bytes) -> None:
        """Rank 0 sends a random challenge; every rank answers with a MAC of it under the secret,
        gathered on rank 0, which sends its verdict sealed under the session key (of the secret
        and the challenge), the key of every later message. A rank without the secret is refused by rank 0,
        and a rank 0 without it by every other rank, before any step or prompt moves."""
        challenge = torch.frombuffer(bytearray(os.urandom(32)), dtype=torch.uint8) if self.rank == 0 \
            else torch.empty(32, dtype=torch.uint8)
        self._bcast(challenge)
        c = challenge.numpy().tobytes()
        proofs = self.gather(torch.frombuffer(bytearray(mac(secret, b"rank", str(self.rank).encode(), c)),
                                              dtype=torch.uint8))
        self.key = mac(secret, b"session", c)
        if self.rank == 0:
            refused = [r for r, p in enumerate(proofs)
                       if not hmac.compare_digest(p.numpy().tobytes(), mac(secret, b"rank", str(r).encode(), c))]
            self.broadcast(refused)
        else:
            refused = self.receive()
        if refused:
            raise PeerRefused(f"tensor-parallel ranks {refused} did not prove the group's secret: the group is refused")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        t = time.perf_counter()
        if self.shm is not None and x.is_contiguous():
            self._shm(self.shm.all_reduce, "an all-reduce", x)
        else:
            self._wait(self.pg.allreduce([x]), "an all-reduce")
        self.allreduce_s += time.perf_counter() - t
        self.allreduces += 1
        return x

    def _wait(self, work, what: str) -> None:
        try:
            work.wait()
        except RuntimeError as e:
            self._failed(what, e)

    def _shm(self, op, what: str, *args):
        try:
            return op(*args)
        except shm_mod.PeerGone as e:
            self._failed(what, e)

    def _failed(self, what: str, e: RuntimeError):
        if self.on_failure is not None:
            self.on_failure()
            self.on_failure = None
        raise RankFailed(f"{what} over the tensor-parallel group failed (a rank died or stopped "
                         f"answering): {e}") from e

    def _bcast(self, t: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self._wait(self.pg.broadcast([t], opts), "a broadcast")

    def broadcast_tensor(self, t: torch.Tensor) -> None:
        """Rank 0's `t` into every other rank's `t` (of the same shape and dtype), as raw as
        `scatter` moves KV."""
        self._bcast(t)

    def broadcast(self, obj) -> None:
        """Rank 0: send `obj` (what engine/parallel/wire.encode takes) to every other rank, sealed.
        With `posted` (a pipeline's group), point to point and not waited for: rank 0 goes on
        while a stage still computes an earlier micro-batch (a gloo broadcast waits for it)."""
        data = seal(self.key, self.seq, encode(obj))
        if self.posted:
            for r in range(1, self.world):
                self.isend(torch.tensor([len(data)]), r, MESSAGES)
                self.isend(torch.frombuffer(bytearray(data), dtype=torch.uint8), r, MESSAGES)
            if self.shm is not None:
                self.shm.ring(self.seq + 1)
        else:
            self._send_raw(data)
        self.seq += 1

    def _send_raw(self, data: bytes) -> None:
        if self.shm is not None:
            self._shm(self.shm.send, "a broadcast", data)
            return
        self._bcast(torch.tensor([len(data)]))
        self._bcast(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def receive(self, device: str = "cpu"):
        """Another rank: rank 0's next message, its tensors on `device`. Raises PeerRefused
        (and takes this rank out) when it is not sealed by a holder of the group's secret."""
        if self.shm is not None and not self.posted:
            try:
                data = self._shm(self.shm.receive, "receiving rank 0's command", MAX_MESSAGE)
            except ValueError as e:
                raise PeerRefused(f"a tensor-parallel message is refused: {e}") from e
            payload = unseal(self.key, self.seq, data)
            self.seq += 1
            return decode(payload, device)
        if self.posted and self.shm is not None:  # an idle pipeline waits here, not in gloo's timed receive
            self._shm(self.shm.wait_rung, "waiting for rank 0's command", self.seq + 1)
        n = self.recv((1,), torch.long, 0, MESSAGES) if self.posted else torch.zeros(1, dtype=torch.long)
        if not self.posted:
            self._bcast(n)
        if not 0 < int(n) <= MAX_MESSAGE:
            raise PeerRefused(f"a tensor-parallel message of {int(n)} bytes is refused")
        data = self.recv((int(n),), torch.uint8, 0, MESSAGES) if self.posted else torch.empty(int(n), dtype=torch.uint8)
        if not self.posted:
            self._bcast(data)
        payload = unseal(self.key, self.seq, data.numpy().tobytes())
        self.seq += 1
        return decode(payload, device)

    def gather(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `t` on rank 0 (None elsewhere)."""
        if self.shm is not None:
            t = t.contiguous()
            out = [torch.empty_like(t) for _ in range(self.world)] if self.rank == 0 else None
            self._shm(self.shm.gather, "gathering KV", t, out, [t.nbytes] * self.world)
            return out
        opts = dist.GatherOptions()
        opts.rootRank = 0
        out = [[torch.empty_like(t) for _ in range(self.world)]] if self.rank == 0 else []
        self._wait(self.pg.gather(out, [t], opts), "gathering KV")
        return out[0] if self.rank == 0 else None

    def gather_columns(self, t: torch.Tensor) -> torch.Tensor | None:
        """Every rank's (rows, widths[rank]) `t` side by side on rank 0 (None elsewhere). Gloo
        gathers equal shapes: there each part travels padded to the widest."""
        t0, wide = time.perf_counter(), max(self.widths)
        if self.shm is not None:  # each part as it is: no padding
            t = t.contiguous()
            rows, size = t.shape[:-1], t.element_size() * t[..., :1].numel()
            out = [t.new_empty(*rows, w) for w in self.widths] if self.rank == 0 else None
            self._shm(self.shm.gather, "gathering the logits", t, out, [size * w for w in self.widths])
            self.gather_s += time.perf_counter() - t0
            return None if out is None else torch.cat(out, dim=-1)
        if t.shape[-1] < wide:
            t = torch.nn.functional.pad(t, (0, wide - t.shape[-1]))
        parts = self.gather(t)
        self.gather_s += time.perf_counter() - t0
        if parts is None:
            return None
        return torch.cat([p[..., :w] for p, w in zip(parts, self.widths)], dim=-1)

    def scatter(self, parts: list[torch.Tensor] | None, out: torch.Tensor) -> None:
        """Rank 0's parts[r] into rank r's `out`."""
        opts = dist.ScatterOptions()
        opts.rootRank = 0
        self._wait(self.pg.scatter([out], [parts] if self.rank == 0 else [], opts), "scattering KV")

    def send(self, t: torch.Tensor, dst: int) -> None:
        """`t`'s bytes to rank `dst` alone (point to point: a pipeline's activations and KV)."""
        if t.numel():
            self._wait(self.pg.send([t.contiguous().view(-1).view(torch.uint8)], dst, 0), f"sending to rank {dst}")

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, tag: int = 0) -> torch.Tensor:
        """A tensor of `shape` and `dtype` from rank `src` (what its `send` sent)."""
        work, out = self.irecv(shape, dtype, src, tag)
        self.finish(work, src)
        return out

    def isend(self, t: torch.Tensor, dst: int, tag: int = 0) -> None:
        """`t`'s bytes to rank `dst`, not waited for: gloo moves them once `dst` receives, and
        keeps them till then; a rank that died shows in a later wait. At most `SENT_KEPT` sends
        are held: gloo's send works report completion only to `wait`, so the oldest, which a
        pipeline's stages received several micro-batches ago, are waited for (at once) and
        dropped with their buffers; a rank that has fallen that far behind holds this one up."""
        while len(self._sent) >= SENT_KEPT:
            work, _ = self._sent.popleft()
            self._wait(work, f"sending to rank {dst}")
        if t.numel():
            buf = t.contiguous().view(-1).view(torch.uint8)
            try:  # gloo raises here at once when it knows `dst` is gone
                self._sent.append((self.pg.send([buf], dst, tag), buf))
            except RuntimeError as e:
                self._failed(f"sending to rank {dst}", e)

    def irecv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, tag: int = 0):
        """Post a receive from rank `src`: (its work, the tensor it fills); `finish` waits."""
        out = torch.empty(shape, dtype=dtype)
        try:
            return (self.pg.recv([out.view(-1).view(torch.uint8)], src, tag) if out.numel() else None), out
        except RuntimeError as e:
            self._failed(f"receiving from rank {src}", e)

    def finish(self, work, src: int) -> None:
        """Wait for `irecv`'s work (RankFailed if rank `src` died)."""
        if work is not None:
            self._wait(work, f"receiving from rank {src}")

    def close(self) -> None:
        self.pg = None
        if self.shm is not None:
            self.shm.close()
            self.shm = None
