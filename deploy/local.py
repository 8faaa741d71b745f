"""An in-process cluster: prefill and decode workers and the router on one asyncio loop in a
background thread, sharing one copy of the weights. Used by tests and single-box runs; the
Ray launcher (deploy/launch.py) runs the same worker classes in separate actors."""
from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

import uvicorn

from decode_worker.service import DecodeWorker
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.tokenizer import Tokenizer
from engine.weights import LoadedModel
from kv_transfer.grpc_transport import GrpcKVSender
from prefill_worker.service import PrefillWorker
from router.app import Router, create_app
from router.cluster import ClusterClient, WorkerEndpoint


@dataclass
class LocalClusterConfig:
    num_prefill: int = 1
    num_decode: int = 1
    policy: str = "prefix_aware"
    cluster_token: str = ""
    host: str = "127.0.0.1"
    port: int = 0
    model_name: str = "default"
    transfer_policy: str = "recompute"
    local_prefill_threshold: int = 0
    engine: EngineConfig = field(default_factory=EngineConfig)


class LocalCluster:
    def __init__(self, loaded: LoadedModel, tokenizer: Tokenizer, config: LocalClusterConfig):
        self.loaded, self.tokenizer, self.config = loaded, tokenizer, config
        self.prefill: list[PrefillWorker] = []
        self.decode: list[DecodeWorker] = []
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="local-cluster", daemon=True)
        self._server: uvicorn.Server | None = None
        self._serve_task = None
        self.url = ""

    def _engine(self) -> AsyncEngine:
        return AsyncEngine(LLMEngine(self.loaded, self.config.engine, self.tokenizer))

    async def _start(self) -> None:
        c = self.config
        for i in range(c.num_prefill):
            w = PrefillWorker(self._engine(), GrpcKVSender(f"prefill-{i}", c.cluster_token), f"prefill-{i}", c.cluster_token)
            await w.start(c.host)
            self.prefill.append(w)
        for i in range(c.num_decode):
            w = DecodeWorker(self._engine(), f"decode-{i}", c.cluster_token, c.transfer_policy,
                             local_prefill_threshold=c.local_prefill_threshold)
            await w.start(c.host)
            self.decode.append(w)
        cluster = ClusterClient(c.policy, c.engine.cache.block_size, c.engine.cache.cache_namespace, c.cluster_token)
        cluster.set_workers([WorkerEndpoint(w.worker_id, "prefill", w.address) for w in self.prefill] +
                            [WorkerEndpoint(w.worker_id, "decode", w.address) for w in self.decode])
        self.router = Router(cluster, self.tokenizer, c.model_name, refresh_interval_s=0.2)
        server = uvicorn.Server(uvicorn.Config(create_app(self.router), host=c.host, port=c.port, log_level="warning",
                                               lifespan="on"))
        self._server = server
        self._serve_task = asyncio.ensure_future(server.serve())
        while not server.started:
            if self._serve_task.done():
                self._serve_task.result()  # raises the startup error
            await asyncio.sleep(0.02)
        port = server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://{c.host}:{port}"
        while not cluster.ready():
            await asyncio.sleep(0.05)

    async def _stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            await self._serve_task
        for w in self.decode + self.prefill:
            await w.stop()

    def start(self) -> "LocalCluster":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout=120)
        return self

    def run(self, coro, timeout: float = 60):
        """Run a coroutine on the cluster's loop from another thread."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=timeout)

    def stop(self) -> None:
        try:
            self.run(self._stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
            self.loop.close()

    def engines(self) -> list[LLMEngine]:
        return [w.engine.engine for w in self.prefill + self.decode]
