"""Ray actor pools for the prefill and decode workers.

Each pool is a group of Ray actors with its own resource request, started and stopped on its
own. An actor loads the model itself (nothing big crosses Ray's object store) and hosts one
`HostedWorker`: its engine thread, gRPC services, KV events and registry heartbeat.
"""
from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, replace

import ray
from ray.exceptions import RayError

from .worker_host import HostedWorker, WorkerSpec


@ray.remote
class WorkerActor:
    """One worker in its own process. Async actor: the gRPC servers share its event loop."""

    def __init__(self, spec: WorkerSpec):
        import torch

        from engine.tokenizer import Tokenizer
        from engine.weights import load_model

        self.spec = spec
        if spec.engine.num_threads:
            torch.set_num_threads(spec.engine.num_threads)
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[spec.engine.dtype]
        loaded = load_model(spec.engine.model or None, dtype, spec.engine.device, spec.engine.max_model_len,
                            spec.engine.packed_weights)
        self.host = HostedWorker(spec, loaded, Tokenizer.from_model_path(loaded.path))
        self._record: dict | None = None
        self._starting: asyncio.Lock | None = None

    async def start(self) -> dict:
        """Start serving and registering (once); later calls return the same record. After
        Ray restarts a dead actor, the pool's supervisor calls this to bring it back."""
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self._record is None:
                record = await self.host.start()
                self._record = record.__dict__ | {"pid": os.getpid()}
        return self._record

    async def stats(self) -> dict:
        e = self.host.engine
        return {"used_blocks": e.blocks.num_used_blocks, "unfinished": e.scheduler.num_unfinished}

    async def stop(self) -> None:
        await self.host.stop()


@dataclass
class PoolSpec:
    role: str
    replicas: int
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    max_queue: int = 0
    max_restarts: int = 10         # Ray restarts a dead worker process up to this many times (-1: always)


class Pool:
    """A group of WorkerActors of one role."""

    def __init__(self, spec: PoolSpec, base: WorkerSpec, name_prefix: str = ""):
        self.spec, self.base = spec, base
        self.name_prefix = name_prefix
        self.actors: list = []
        self.records: list[dict] = []

    def launch(self) -> list:
        """Create the actors and ask them to start; returns the pending start results."""
        s = self.spec
        opts = dict(num_cpus=s.num_cpus, num_gpus=s.num_gpus, max_restarts=s.max_restarts)
        for i in range(s.replicas):
            threads = self.base.engine.num_threads or max(1, int(s.num_cpus))
            spec = replace(self.base, role=s.role, worker_id=f"{self.name_prefix}{s.role}-{i}", max_queue=s.max_queue,
                           engine=replace(self.base.engine, num_threads=threads))
            self.actors.append(WorkerActor.options(**opts).remote(spec))
        return [a.start.remote() for a in self.actors]

    def wait(self, refs: list) -> list[dict]:
        self.records = ray.get(refs)
        self._down_since: list[float | None] = [None] * len(self.records)
        return self.records

    def start(self) -> list[dict]:
        return self.wait(self.launch())

    def supervise_once(self, timeout_s: float = 1.0) -> list[str]:
        """Ask every actor to be started. An actor Ray restarted after its process died loads
        its model again; this starts its services, and it re-registers under its worker id
        (new incarnation, new address). Returns a line per worker that came back."""
        refs = [a.start.remote() for a in self.actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        notes = []
        for i, ref in enumerate(refs):
            if ref not in ready:
                if self._down_since[i] is None:
                    self._down_since[i] = time.monotonic()  # restarting, or stuck: not answering
                continue
            try:
                record = ray.get(ref)
            except RayError:  # dead for good (restarts used up), died again, or failed to start
                continue
            old = self.records[i]
            if record["pid"] != old["pid"] or record["incarnation"] != old["incarnation"]:
                since = self._down_since[i]
                took = f" after {time.monotonic() - since:.1f}s" if since is not None else ""
                notes.append(f"{record['role']} worker {record['worker_id']} restarted{took}: pid {old['pid']} -> "
                             f"{record['pid']}, {record['address']}")
                self.records[i] = record
            self._down_since[i] = None
        return notes

    def stop(self) -> None:
        if self.actors:
            try:
                ray.get([a.stop.remote() for a in self.actors], timeout=30)
            except Exception:  # noqa: BLE001 - a dead actor is stopped already
                pass
            for a in self.actors:
                ray.kill(a)
        self.actors, self.records = [], []
