"""The collectives of a group over shared memory (engine/parallel/shm.py): sums in rank order,
the same bits on every rank, parts larger than a slot, a peer that exits seen at once and one
that never answers at the timeout; through the engine, a tensor-parallel group and a pipeline
idle for longer than their timeout still step, the segment is gone once the group formed
and unmapped when it stops, and a group whose segment cannot be made steps as well over gloo."""
from __future__ import annotations

import glob
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.core.engine import LLMEngine
from pdserve.engine.parallel import shm
from pdserve.engine.parallel.tp import ModelSource


@pytest.fixture
def segment():
    made = []

    def make(world: int) -> str:
        made.append(shm.create(world))
        return made[-1]
    yield make
    for path in made:
        os.unlink(path)


def on_ranks(path: str, world: int, fn, timeout_s: float = 30.0) -> list:
    """fn(group) on `world` ranks, each a thread of this process with its own view: their results."""
    out, errors = [None] * world, []

    def run(rank):
        g = shm.ShmGroup(path, rank, world, timeout_s)
        try:
            out[rank] = fn(g)
        except Exception as e:  # noqa: BLE001 - reported below, with its rank
            errors.append((rank, e))
        finally:
            g.close()
    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    assert not errors, errors
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_reduce_sums_in_rank_order_with_the_same_bits_on_every_rank(segment, dtype):
    world, sizes = 3, [576, 5 * shm.SLOT_BYTES // 4 + 3]  # a decode row, and parts over five slots
    parts = {n: [torch.randn(n, generator=torch.Generator().manual_seed(r)).to(dtype) for r in range(world)]
             for n in sizes}
    got = on_ranks(segment(world), world, lambda g: [g.all_reduce(parts[n][g.rank].clone()) for n in sizes])
    for i, n in enumerate(sizes):
        want = parts[n][0].clone()
        for p in parts[n][1:]:
            want.add_(p)
        for rank in range(world):
            assert torch.equal(got[rank][i], want), (n, rank)


def test_a_message_and_a_gather_larger_than_a_slot(segment):
    world, message = 3, os.urandom(3 * shm.SLOT_BYTES + 17)
    sizes = [shm.SLOT_BYTES + 8, 12, 2 * shm.SLOT_BYTES]  # bytes, different for each rank

    def run(g):
        got = g.send(message) if g.rank == 0 else g.receive(len(message))
        mine = torch.full((sizes[g.rank],), g.rank + 1, dtype=torch.uint8)
        outs = [torch.zeros(n, dtype=torch.uint8) for n in sizes] if g.rank == 0 else None
        g.gather(mine, outs, sizes)
        return got, outs
    (_, outs), *others = on_ranks(segment(world), world, run)
    assert [got for got, _ in others] == [message, message]
    assert [torch.equal(o, torch.full((n,), r + 1, dtype=torch.uint8)) for r, (o, n) in enumerate(zip(outs, sizes))] \
        == [True] * world


def test_a_length_over_the_limit_is_refused_before_it_is_read(segment):
    def run(g):
        if g.rank == 0:
            return g.send(b"x" * 100)
        with pytest.raises(ValueError, match="100 bytes"):
            g.receive(99)
    on_ranks(segment(2), 2, run)


def test_a_peer_that_exits_is_seen_at_once_and_one_that_never_answers_at_the_timeout(segment):
    path = segment(2)
    peer = subprocess.run([sys.executable, "-c", f"from pdserve.engine.parallel import shm; shm.ShmGroup({path!r}, 1, 2, 5)"],
                          check=True, timeout=120)
    assert peer.returncode == 0
    g = shm.ShmGroup(path, 0, 2, timeout_s=60.0)
    t = time.monotonic()
    with pytest.raises(shm.PeerGone, match=r"rank\(s\) \[1\]"):
        g.all_reduce(torch.ones(4))
    assert time.monotonic() - t < 10  # its process is gone: not the 60 s timeout
    g.close()

    alive = shm.ShmGroup(segment(2), 0, 2, timeout_s=0.3)  # rank 1 is this process, which never joins in
    alive._pids[1] = os.getpid()
    t = time.monotonic()
    with pytest.raises(shm.PeerGone, match="within 0 s"):
        alive.all_reduce(torch.ones(4))
    assert 0.3 <= time.monotonic() - t < 10
    alive.close()


def test_a_rank_that_maps_the_segment_late_is_waited_for(segment):
    path = segment(2)

    def late():
        time.sleep(0.5)  # ten of the waiting rank's looks at its peers, which see no pid yet
        g = shm.ShmGroup(path, 1, 2, 30.0)
        g.all_reduce(torch.ones(4))
        g.close()
    peer = threading.Thread(target=late)
    peer.start()
    g = shm.ShmGroup(path, 0, 2, 30.0)
    assert torch.equal(g.all_reduce(torch.ones(4)), torch.full((4,), 2.0))
    g.close()
    peer.join(30)


def test_a_receive_waits_for_rank_0_however_long_it_is_idle(segment):
    def run(g):
        if g.rank == 0:
            time.sleep(1.0)  # 5x the group's timeout
            return g.send(b"step")
        return g.receive(100)
    assert on_ranks(segment(2), 2, run, timeout_s=0.2)[1] == b"step"


def _present() -> set[str]:
    return set(glob.glob("/dev/shm/pdserve-tp-*"))


def _mapped() -> set[str]:
    """The segments this process maps (other processes' groups, a second pytest worker's
    among them, may have theirs on /dev/shm meanwhile)."""
    with open("/proc/self/maps") as f:
        return {word for line in f for word in line.split() if word.startswith("/dev/shm/pdserve-tp-")}


def test_groups_idle_past_their_timeout_still_step_and_leave_no_segment():
    """Gloo's receive ended at the group's timeout: a pool idle for a minute lost its ranks. A
    tensor-parallel group and a pipeline, idle together for longer than their 3 s timeout."""
    mapped = _mapped()
    engines, params = [], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    try:
        for pipeline in (False, True):
            cfg = EngineConfig(quantization="none", cache=CacheConfig(kv_cache_memory=16 << 20),
                               pipeline_parallel_size=2 if pipeline else 1)
            engines.append(LLMEngine.tensor_parallel(ModelSource(tiny_seed=0), cfg, 2, pipeline=pipeline,
                                                     timeout_s=3.0))
        assert all(e.tp.group.shm is not None for e in engines)
        ours = _mapped() - mapped
        assert len(ours) == 2 and not ours & _present()  # unlinked once every rank had it mapped
        first = [e.generate([[1, 2, 3]], params) for e in engines]
        time.sleep(3.5)
        assert [e.tp.dead_ranks() for e in engines] == [[], []]
        assert [e.generate([[1, 2, 3]], params) for e in engines] == first
        assert [e.blocks.num_used_blocks for e in engines] == [0, 0]
    finally:
        for e in engines:
            e.shutdown()
    assert _mapped() == mapped  # unmapped at shutdown: its memory went back


def test_without_a_segment_the_group_steps_over_gloo_and_says_so(monkeypatch, capfd):
    cfg = EngineConfig(quantization="none", cache=CacheConfig(kv_cache_memory=16 << 20))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outs = []
    for make in (shm.create, None):
        if make is None:
            def refuse(world):
                raise OSError(28, "No space left on device")
            monkeypatch.setattr(shm, "create", refuse)
        e = LLMEngine.tensor_parallel(ModelSource(tiny_seed=0), cfg, 2)
        try:
            assert (e.tp.group.shm is None) == (make is None)
            outs.append(e.generate([[5, 6, 7], [9, 8]], params))
        finally:
            e.shutdown()
    assert outs[0] == outs[1]
    assert "no shared-memory segment ([Errno 28] No space left on device): its collectives go through gloo" \
        in capfd.readouterr().err


def test_a_rank_that_never_maps_the_segment_leaves_no_file_and_no_mapping(monkeypatch):
    """Rank 0 made the segment and sent its path; rank 1 died before mapping it (here it raises,
    in its thread): rank 0's wait ends at the group's timeout, and the file and its own
    mapping go with it (a first start's kernel build, slower than a 3 s timeout, had left one)."""
    from datetime import timedelta

    import torch.distributed as dist

    from pdserve.engine.parallel.group import Group, group_store
    from pdserve.engine.parallel.wire import group_secret, store_prefix

    made, real_create, real_group = [], shm.create, shm.ShmGroup

    def create(world):
        made.append(real_create(world))
        return made[-1]

    def group(path, rank, world, timeout_s):
        if rank != 0:
            raise RuntimeError("rank 1 died")
        return real_group(path, rank, world, timeout_s)
    monkeypatch.setattr(shm, "create", create)
    monkeypatch.setattr(shm, "ShmGroup", group)
    mapped, secret, out = _mapped(), group_secret(), {}
    host, _ = group_store("127.0.0.1", 0, 2, True, 3.0, secret)

    def join(rank: int):
        own = host if rank == 0 else dist.TCPStore("127.0.0.1", host.port, 2, False, timeout=timedelta(seconds=3))
        try:
            out[rank] = Group(rank, 2, dist.PrefixStore(store_prefix(secret), own), 3.0, secret)
        except Exception as e:  # noqa: BLE001 - the test reads what each rank raised
            out[rank] = e
    threads = [threading.Thread(target=join, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert isinstance(out[1], RuntimeError) and isinstance(out[0], Exception), out
    assert len(made) == 1 and not os.path.exists(made[0])
    assert _mapped() == mapped
