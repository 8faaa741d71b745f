"""Starts one worker (prefill, decode or aggregated) with everything around it: its engine
thread, gRPC services, KV events to Redis and its registry heartbeat. The same code runs in
a Ray actor (deploy/launch.py) and in the in-process cluster (deploy/local.py)."""
from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from dataclasses import replace

from pdserve.config import WorkerConfig
from pdserve.decode_worker.service import DecodeWorker
from pdserve.engine.core.async_engine import AsyncEngine
from pdserve.engine.config import EngineConfig
from pdserve.engine.parallel.cores import CoreShare
from pdserve.engine.core.engine import LLMEngine
from pdserve.common.gc_quiet import freeze_startup
from pdserve.common.model_files import served_model_name
from pdserve.common.tokenizer import Tokenizer
from pdserve.engine.parallel.tp import ModelSource
from pdserve.engine.model.weights import LoadedModel, load_for_config, resolve_model_path
from pdserve.kv_transfer.senders import SchemeKVSender
from pdserve.prefill_worker.service import PrefillWorker
from pdserve.protos.tracing import Tracer
from pdserve.registry.events import EventPublisher
from pdserve.registry.membership import WorkerRecord, WorkerRegistration

from .model_server_metrics import ModelServerMetrics

log = logging.getLogger("pdserve.worker")


def load_worker_model(engine: EngineConfig) -> tuple[LoadedModel | None, Tokenizer]:
    """The model a worker serves and its tokenizer; no model for a tensor-, expert- or
    pipeline-parallel worker (its ranks load their own slices, see HostedWorker)."""
    if max(engine.tensor_parallel_size, engine.expert_parallel_size, engine.pipeline_parallel_size) > 1:
        return None, Tokenizer.from_model_path(resolve_model_path(engine.model or None))
    loaded = load_for_config(engine)
    return loaded, Tokenizer.from_model_path(loaded.path)


class HostedWorker:
    def __init__(self, config: WorkerConfig, loaded: LoadedModel | None, tokenizer: Tokenizer,
                 exit_on_engine_death: bool = False):
        """exit_on_engine_death: when the engine thread dies (a bug, or a rank of its
        tensor-parallel group), leave the registry and end the process, so that Ray (or the
        process supervisor) starts a fresh worker; off, the worker only leaves the registry (a
        worker hosted inside another program). `loaded` None: a tensor-parallel group of
        `engine.tensor_parallel_size` ranks, an expert-parallel one of `engine.expert_parallel_size`
        or a pipeline of `engine.pipeline_parallel_size` stages (of `engine.tensor_parallel_size`
        ranks each), reading the configured model."""
        self.config = c = config
        self.exit_on_engine_death = exit_on_engine_death
        self._watchdog: asyncio.Task | None = None
        registry, security, transfer = c.registry, c.security, c.transfer
        self.publisher = (EventPublisher(registry.redis_url, registry.cluster_name, c.worker_id)
                          if registry.redis_url else None)
        self.cores = (CoreShare(c.core_share_dir, c.worker_id, own_threads=c.engine.num_threads or 1)
                      if c.core_share_dir else None)
        # token ids only: the router detokenizes and applies stop strings
        engine_config = replace(c.engine, detokenize=False)
        if loaded is None:
            ep, pp = c.engine.expert_parallel_size, c.engine.pipeline_parallel_size
            core = LLMEngine.tensor_parallel(ModelSource(c.engine.model), engine_config,  # PP x TP: pp * tp ranks
                                             c.engine.tensor_parallel_size * ep * pp, tokenizer,
                                             event_listener=self.publisher, expert=ep > 1, pipeline=pp > 1)
        else:
            core = LLMEngine(loaded, engine_config, tokenizer, self.publisher)
        engine = AsyncEngine(core, cores=self.cores)
        # an aggregated worker is a decode worker that prefills itself: its spans are decode's
        self.tracer = tracer = Tracer(c.tracing.otlp_traces_endpoint,
                                      "pdserve-prefill" if c.role == "prefill" else "pdserve-decode", c.worker_id)
        if c.role == "prefill":
            sender = SchemeKVSender(c.worker_id, security.cluster_token, tls=security.tls)
            self.worker = PrefillWorker(engine, sender, worker_id=c.worker_id, max_queue=c.max_queue,
                                        transfer=transfer, security=security, tracer=tracer)
        else:  # decode, or aggregated: a decode worker that always prefills itself
            self.worker = DecodeWorker(engine, worker_id=c.worker_id, max_queue=c.max_queue, transfer=transfer,
                                       security=security, tracer=tracer)
        self.registration: WorkerRegistration | None = None
        self.metrics: ModelServerMetrics | None = None  # its own /metrics, from start() (unless metrics_port -1)

    @property
    def registry_error(self) -> str:
        """Why this worker is not in the registry ("": it is, or it has none)."""
        return self.registration.last_error if self.registration is not None else ""

    @property
    def engine(self) -> LLMEngine:
        return self.worker.engine.engine

    async def start(self) -> WorkerRecord:
        c = self.config
        address = await self.worker.start(c.host)
        if c.metrics_port >= 0:
            self.metrics = ModelServerMetrics(self.worker.engine, served_model_name(self.engine.loaded.path),
                                              address.rpartition(":")[0], c.metrics_port)
            try:
                self.worker.metrics_port = await asyncio.to_thread(self.metrics.start)
            except OSError as e:  # its host serves another worker's on that port: take a free one
                if not c.metrics_port:
                    raise
                log.warning("%s: metrics port %d unavailable (%s); serving /metrics on a free port",
                            c.worker_id, c.metrics_port, e)
                self.metrics.port = 0
                self.worker.metrics_port = await asyncio.to_thread(self.metrics.start)
        record = WorkerRecord(worker_id=c.worker_id, role=c.role, address=address,
                              kv_address=getattr(self.worker, "kv_address", ""), incarnation=uuid.uuid4().hex,
                              metrics_port=self.metrics.port if self.metrics else 0)
        if self.publisher is not None:
            await self.publisher.reset_stream()
            self.publisher.start()
            self.registration = WorkerRegistration(c.registry.redis_url, c.registry.cluster_name, record)
            await self.registration.beat()  # a failure is retried every interval, and reported
            self.registration.start()
        self.record = record
        self._watchdog = asyncio.create_task(self._watch_engine())
        if self.exit_on_engine_death:  # a process of its own: in another program, its garbage would stay
            freeze_startup()  # full collections then skip the model, the libraries and the server
        return record

    async def _watch_engine(self, interval_s: float = 0.5) -> None:
        """A dead engine thread, or a tensor-parallel group with a rank gone (noticed even while
        idle, before a request steps into it), must not keep a live registration: its heartbeat
        would draw requests that can only fail."""
        engine, group = self.worker.engine, self.engine.tp
        while engine.error is None and not (group is not None and group.dead_ranks()):
            await asyncio.sleep(interval_s)
        why = repr(engine.error) if engine.error is not None else f"tensor-parallel ranks {group.dead_ranks()} exited"
        log.error("worker %s: its engine stopped (%s); leaving the registry", self.config.worker_id, why)
        if self.registration is not None:
            await self.registration.stop()
            self.registration = None
        if self.exit_on_engine_death:
            os._exit(70)  # EX_SOFTWARE; Ray restarts the actor (max_restarts), which re-registers

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
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self.registration is not None:
            await self.registration.stop()
        if self.metrics is not None:
            await asyncio.to_thread(self.metrics.stop)
        await self.worker.stop()
        self.engine.shutdown()
        if self.cores is not None:  # the engine thread has stopped with the worker
            self.cores.close()
        if self.publisher is not None:
            await self.publisher.stop()
        await asyncio.to_thread(self.tracer.shutdown)  # exports what is buffered (an HTTP post)
