"""An in-process cluster: workers and the router on one asyncio loop in a background thread,
sharing one copy of the weights. Used by tests, benchmarks and single-box runs; the Ray
launcher (deploy/launch.py) hosts the same `HostedWorker`s in separate actors."""
from __future__ import annotations

import asyncio
import threading
from dataclasses import replace

import uvicorn

from pdserve.config import ClusterConfig
from pdserve.engine.core.engine import LLMEngine
from pdserve.common.tokenizer import Tokenizer
from pdserve.common.model_files import served_model_name
from pdserve.engine.model.weights import LoadedModel
from pdserve.router.app import create_app
from pdserve.router.cluster import WorkerEndpoint
from pdserve.router.router import Router

from .worker_host import HostedWorker


class LocalCluster:
    def __init__(self, loaded: LoadedModel, tokenizer: Tokenizer, config: ClusterConfig):
        """The cluster `config` describes, in this process: its pools' workers (by their
        replicas and queues) and its router (on `config.router.port`, 0 for any free port).
        Without a registry (`config.registry.redis_url` empty) the router is wired to the
        workers directly and follows no KV events."""
        self.loaded, self.tokenizer, self.config = loaded, tokenizer, config
        self.workers: list[HostedWorker] = []
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="local-cluster", daemon=True)
        self._server: uvicorn.Server | None = None
        self._serve_task = None
        self.url = ""

    async def _start(self) -> None:
        c = self.config
        for role, pool in c.pools().items():
            for i in range(pool.replicas):
                wc = c.worker(role, f"{role}-{i}")  # a tensor/expert-parallel worker's ranks load their own slices
                group = max(wc.engine.tensor_parallel_size, wc.engine.expert_parallel_size,
                            wc.engine.pipeline_parallel_size) > 1
                w = HostedWorker(wc, None if group else self.loaded, self.tokenizer)
                await w.start()
                self.workers.append(w)
        rc = replace(c.router, model_name=c.router.model_name or served_model_name(self.loaded.path),
                     refresh_interval_s=0.1)
        self.router = Router.from_config(replace(c, router=rc), self.tokenizer, workers=[
            WorkerEndpoint(worker_id=w.record.worker_id, role=w.record.role, address=w.record.address)
            for w in self.workers])
        cluster = self.router.cluster
        server = uvicorn.Server(uvicorn.Config(create_app(self.router), host=rc.host, port=rc.port,
                                               log_level="warning", lifespan="on",
                                               timeout_graceful_shutdown=10))
        self._server = server
        self._serve_task = asyncio.ensure_future(server.serve())
        while not server.started:
            if self._serve_task.done():
                self._serve_task.result()  # raises the startup error
            await asyncio.sleep(0.02)
        self.url = f"http://{rc.host}:{server.servers[0].sockets[0].getsockname()[1]}"
        while not (cluster.ready() and len(cluster.workers) == len(self.workers)):
            await asyncio.sleep(0.05)

    async def _stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            await self._serve_task
            await asyncio.to_thread(self.router.tracer.shutdown)
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
        return next(w for w in self.workers if w.config.worker_id == worker_id)

    def engines(self) -> list[LLMEngine]:
        return [w.engine for w in self.workers]
