"""One all-reduce of a decode row (576 fp32 values, SmolLM2's hidden size) among 2 and 3
processes of this host, one thread each: gloo over loopback TCP (what a tensor-parallel group
used before engine/parallel/shm.py) against the shared-memory segment a group now uses.
Medians of 3 runs of 3,000 all-reduces each, microseconds. Writes
bench/experiments/collectives-results.json.

    . .venv/bin/activate && python bench/experiments/collectives.py
"""
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import time
from pathlib import Path

import torch
import torch.distributed as dist

from pdserve.engine.parallel import shm
from pdserve.registry.embedded import free_port

N, WARM = 3000, 200


def _time(all_reduce, rank: int, q) -> None:
    """Rank 0 puts the mean microseconds of N all-reduces of one decode row, after WARM."""
    torch.set_num_threads(1)
    x = torch.ones(576)
    for _ in range(WARM):
        all_reduce(x)
    t = time.perf_counter()
    for _ in range(N):
        all_reduce(x)
    q.put((time.perf_counter() - t) / N * 1e6) if rank == 0 else None
    all_reduce(x)  # nobody leaves while another still waits


def _gloo(rank: int, world: int, port: int, q) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    _time(dist.all_reduce, rank, q)
    dist.destroy_process_group()


def _shm(rank: int, world: int, path: str, q) -> None:
    g = shm.ShmGroup(path, rank, world, 60.0)
    _time(g.all_reduce, rank, q)
    g.close()


def once(kind: str, world: int) -> float:
    ctx, path = mp.get_context("spawn"), shm.create(world) if kind == "shm" else ""
    q = ctx.Queue()
    args = path if kind == "shm" else free_port()
    procs = [ctx.Process(target=_shm if kind == "shm" else _gloo, args=(r, world, args, q)) for r in range(world)]
    try:
        [p.start() for p in procs]
        return q.get(timeout=300)
    finally:
        [p.join(60) for p in procs]
        if path:
            os.unlink(path)


def main() -> None:
    shm.available()
    out: dict = {"cpu": subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()[:16]}
    for world in (2, 3):
        runs = {kind: [] for kind in ("gloo", "shm")}
        for _ in range(3):
            for kind in runs:
                runs[kind].append(once(kind, world))
        out[f"world_{world}_us"] = {kind: statistics.median(v) for kind, v in runs.items()}
        out[f"world_{world}_runs_us"] = runs
    Path(__file__).with_name("collectives-results.json").write_text(json.dumps(out, indent=1))
    print(json.dumps({k: v for k, v in out.items() if k.endswith("_us")}, indent=1))


if __name__ == "__main__":
    main()
