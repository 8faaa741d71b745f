"""An in-process cluster: workers and the router on one asyncio loop in a background thread,
sharing one copy of the weights. Used by tests, benchmarks and single-box runs; the Ray
launcher (deploy/launch.py) hosts the same `HostedWorker`s in separate actors."""
from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field, replace

import uvicorn

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.tokenizer import Tokenizer
from pdserve.engine.weights import LoadedModel
from pdserve.router.app import Router, RouterConfig, create_app
from pdserve.router.cluster import ClusterClient, WorkerEndpoint
from pdserve.router.discovery import RegistryDiscovery
from pdserve.protos.security import TLSConfig

from .worker_host import HostedWorker, WorkerSpec


@dataclass
class LocalClusterConfig:
    num_prefill: int = 1
    num_decode: int = 1
    mode: str = "disaggregated"    # or "aggregated": decode workers prefill themselves, no prefill pool
    policy: str = "prefix_aware"
    decode_local_prefill: int = 0  # router: a decode worker holding all of a prompt but this many tokens prefills it
    cluster: str = "local"
    cluster_token: str = field(default="", repr=False)
    redis_url: str = field(default="", repr=False)  # "": static wiring, no KV events
    host: str = "127.0.0.1"
    port: int = 0
    model_name: str = "default"
    transfer_policy: str = "recompute"
    local_prefill_threshold: int = 0
    tls: TLSConfig = field(default_factory=TLSConfig)  # mutual TLS between router and workers
    kv_transport: str = "grpc"     # decode workers receive KV over grpc | ucx
    kv_layer_group: int = 0        # prefill workers push KV every N layers (0: at the end)
    prefill_max_queue: int = 0     # per worker; 0: unbounded
    decode_max_queue: int = 0
    engine: EngineConfig = field(default_factory=EngineConfig)
    router: RouterConfig = field(default_factory=RouterConfig)


class LocalCluster:
    def __init__(self, loaded: LoadedModel, tokenizer: Tokenizer, config: LocalClusterConfig):
        self.loaded, self.tokenizer, self.config = loaded, tokenizer, config
        self.workers: list[HostedWorker] = []
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="local-cluster", daemon=True)
        self._server: uvicorn.Server | None = None
        self._serve_task = None
        self.url = ""

    def _specs(self) -> list[WorkerSpec]:
        c = self.config
        base = WorkerSpec("prefill", "", c.cluster, c.redis_url, c.cluster_token, c.host, c.transfer_policy,
                          c.local_prefill_threshold, engine=c.engine, tls=c.tls, kv_transport=c.kv_transport,
                          kv_layer_group=c.kv_layer_group)
        if c.mode == "aggregated":
            return [replace(base, role="aggregated", worker_id=f"aggregated-{i}", max_queue=c.decode_max_queue)
                    for i in range(c.num_decode)]
        return ([replace(base, role="prefill", worker_id=f"prefill-{i}", max_queue=c.prefill_max_queue)
                 for i in range(c.num_prefill)] +
                [replace(base, role="decode", worker_id=f"decode-{i}", max_queue=c.decode_max_queue)
                 for i in range(c.num_decode)])

    async def _start(self) -> None:
        c = self.config
        for spec in self._specs():
            w = HostedWorker(spec, self.loaded, self.tokenizer)
            await w.start()
            self.workers.append(w)
        cluster = ClusterClient(c.policy, c.engine.cache.block_size, c.engine.cache.cache_namespace, c.cluster_token,
                                tls=c.tls, local_prefill_tokens=c.decode_local_prefill)
        discovery = None
        if c.redis_url:
            discovery = RegistryDiscovery(c.redis_url, c.cluster, cluster)
        else:
            cluster.set_workers([WorkerEndpoint(w.record.worker_id, w.record.role, w.record.address)
                                 for w in self.workers])
        self.router = Router(cluster, self.tokenizer, replace(c.router, model_name=c.model_name, refresh_interval_s=0.1),
                             discovery=discovery)
        server = uvicorn.Server(uvicorn.Config(create_app(self.router), host=c.host, port=c.port,
                                               log_level="warning", lifespan="on",
                                               timeout_graceful_shutdown=10))
        self._server = server
        self._serve_task = asyncio.ensure_future(server.serve())
        while not server.started:
            if self._serve_task.done():
                self._serve_task.result()  # raises the startup error
            await asyncio.sleep(0.02)
        self.url = f"http://{c.host}:{server.servers[0].sockets[0].getsockname()[1]}"
        while not (cluster.ready() and len(cluster.workers) == len(self.workers)):
            await asyncio.sleep(0.05)

    async def _stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            await self._serve_task
        for w in self.workers:
            await w.stop()

    def start(self) -> "LocalCluster":
        self._thread.start()
        try:
            self.run(self._start(), timeout=120)
        except BaseException:
            self.stop()
            raise
        return self

    def run(self, coro, timeout: float = 60):
        """Run a coroutine on the cluster's loop from another thread."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=timeout)

    def stop(self) -> None:
        try:
            try:
                self.run(self._stop())
            except TimeoutError:  # say what it is stuck on: a hang here is a bug worth a clear report
                stuck = [t.get_stack() and f"{t.get_name()}: {t.get_coro()!r}\n" + "".join(
                    f"  {f.f_code.co_filename}:{f.f_lineno} {f.f_code.co_name}\n" for f in t.get_stack())
                    for t in asyncio.all_tasks(self.loop)]
                raise TimeoutError("the local cluster did not stop within 60 s; pending tasks:\n" +
                                   "\n".join(stuck)) from None
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
            self.loop.close()

    def worker(self, worker_id: str) -> HostedWorker:
        return next(w for w in self.workers if w.spec.worker_id == worker_id)

    def engines(self) -> list[LLMEngine]:
        return [w.engine for w in self.workers]
