"""Starts one worker (prefill, decode or aggregated) with everything around it: its engine
thread, gRPC services, KV events to Redis and its registry heartbeat. The same code runs in
a Ray actor (deploy/launch.py) and in the in-process cluster (deploy/local.py)."""
from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field

from pdserve.decode_worker.service import DecodeWorker
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.tokenizer import Tokenizer
from pdserve.engine.weights import LoadedModel
from pdserve.kv_transfer.senders import SchemeKVSender
from pdserve.prefill_worker.service import PrefillWorker
from pdserve.protos.security import TLSConfig

from .registry import EventPublisher, WorkerRecord, WorkerRegistration


@dataclass
class WorkerSpec:
    role: str                      # "prefill" | "decode" | "aggregated"
    worker_id: str
    cluster: str = "default"
    redis_url: str = field(default="", repr=False)  # "" : no registry, no events (static wiring)
    cluster_token: str = field(default="", repr=False)
    host: str = "127.0.0.1"
    transfer_policy: str = "recompute"
    local_prefill_threshold: int = 0
    tls: TLSConfig = field(default_factory=TLSConfig)
    kv_transport: str = "grpc"     # what this decode worker receives KV over: grpc | ucx
    kv_layer_group: int = 0        # prefill: push KV every this many layers as they compute (0: at the end)
    max_queue: int = 0             # requests queued at this worker before it refuses more (0: unbounded)
    engine: EngineConfig = field(default_factory=EngineConfig)


class HostedWorker:
    def __init__(self, spec: WorkerSpec, loaded: LoadedModel, tokenizer: Tokenizer):
        self.spec = spec
        self.publisher = EventPublisher(spec.redis_url, spec.cluster, spec.worker_id) if spec.redis_url else None
        engine = AsyncEngine(LLMEngine(loaded, spec.engine, tokenizer, self.publisher))
        if spec.role == "prefill":
            sender = SchemeKVSender(spec.worker_id, spec.cluster_token, tls=spec.tls)
            self.worker = PrefillWorker(engine, sender, spec.worker_id,
                                        spec.cluster_token, spec.max_queue, spec.tls, spec.kv_layer_group)
        else:  # decode, or aggregated: a decode worker that always prefills itself
            self.worker = DecodeWorker(engine, spec.worker_id, spec.cluster_token, spec.transfer_policy,
                                       local_prefill_threshold=spec.local_prefill_threshold, max_queue=spec.max_queue,
                                       tls=spec.tls, kv_transport=spec.kv_transport)
        self.registration: WorkerRegistration | None = None

    @property
    def engine(self) -> LLMEngine:
        return self.worker.engine.engine

    async def start(self) -> WorkerRecord:
        s = self.spec
        address = await self.worker.start(s.host)
        record = WorkerRecord(s.worker_id, s.role, address, getattr(self.worker, "kv_address", ""), uuid.uuid4().hex)
        if self.publisher is not None:
            await self.publisher.reset_stream()
            self.publisher.start()
            self.registration = WorkerRegistration(s.redis_url, s.cluster, record)
            await self.registration.beat()
            self.registration.start()
        self.record = record
        return record

    def busy(self) -> bool:
        """Requests in flight here (queued, running, or a prompt being handed off)."""
        w = self.worker
        return (self.engine.has_unfinished_requests() or getattr(w, "inflight", 0) > 0
                or getattr(w, "queued", 0) > 0)

    def describe_busy(self) -> str:
        """What `busy()` waits on, for a log line."""
        w = self.worker
        return (f"{self.engine.scheduler.num_unfinished} in the engine, {getattr(w, 'inflight', 0)} being handed off, "
                f"{getattr(w, 'queued', 0)} queued")

    async def drain(self, timeout_s: float) -> bool:
        """Leave the pool gracefully: refuse new requests (the router sends them to the rest of
        the pool), leave the registry, and wait up to `timeout_s` for the requests in flight to
        finish. True if they all did; streams still running when it stops are migrated by the
        router to another decode worker."""
        self.worker.draining = True
        if self.registration is not None:
            await self.registration.stop()
            self.registration = None
        deadline = time.monotonic() + timeout_s
        while self.busy():
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.1)
        return True

    async def stop(self) -> None:
        if self.registration is not None:
            await self.registration.stop()
        await self.worker.stop()
        if self.publisher is not None:
            await self.publisher.stop()
