"""Ray actor pools for the prefill and decode workers.

Each pool is a group of Ray actors with its own resource request, started and stopped on its
own. An actor loads the model itself (nothing big crosses Ray's object store) and hosts one
`HostedWorker`: its engine thread, gRPC services, KV events and registry heartbeat.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

import ray

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

    async def start(self) -> dict:
        record = await self.host.start()
        return record.__dict__ | {"pid": os.getpid()}

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
        opts = dict(num_cpus=s.num_cpus, num_gpus=s.num_gpus)
        for i in range(s.replicas):
            threads = self.base.engine.num_threads or max(1, int(s.num_cpus))
            spec = replace(self.base, role=s.role, worker_id=f"{self.name_prefix}{s.role}-{i}", max_queue=s.max_queue,
                           engine=replace(self.base.engine, num_threads=threads))
            self.actors.append(WorkerActor.options(**opts).remote(spec))
        return [a.start.remote() for a in self.actors]

    def wait(self, refs: list) -> list[dict]:
        self.records = ray.get(refs)
        return self.records

    def start(self) -> list[dict]:
        return self.wait(self.launch())

    def stop(self) -> None:
        if self.actors:
            try:
                ray.get([a.stop.remote() for a in self.actors], timeout=30)
            except Exception:  # noqa: BLE001 - a dead actor is stopped already
                pass
            for a in self.actors:
                ray.kill(a)
        self.actors, self.records = [], []
