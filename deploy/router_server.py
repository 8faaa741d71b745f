"""The router as a process: `pdserve up` runs it next to its pools, and `pdserve router`
runs it alone against a running cluster's registry (more routers, or a restarted one: it
keeps no state of its own, so a new router serves as soon as it has read the registry)."""
from __future__ import annotations

import asyncio
import json
import socket
import sys
import time
from dataclasses import replace
from pathlib import Path

import uvicorn


from pdserve.config import LOOPBACK_HOSTS as LOOPBACK
from pdserve.config import ClusterConfig, RouterConfig, SecurityConfig
from pdserve.common.aio import stop_tasks
from pdserve.common.gc_quiet import freeze_startup


def check_exposure(router: RouterConfig, security: SecurityConfig) -> None:
    """Before anything starts: an API open beyond this machine, or a keys file that cannot be
    used (KeysFileError, naming its line), is refused."""
    if security.keys_file:
        from pdserve.router.keys import KeyRing
        KeyRing(security.keys_file)
    if router.host not in LOOPBACK and not security.api_keys and not security.keys_file:
        raise ValueError(f"--host {router.host} exposes the API beyond this machine: set --api-key (or "
                         "PDSERVE_API_KEY) or --keys-file so that only clients with a key are served")


def bind_api(router: RouterConfig) -> socket.socket:
    """The API's listening socket, bound before anything starts: a port in use is refused at once
    (ValueError), and no process started meanwhile (Ray's servers, the workers', on ports the OS
    picks) can take the port before the router listens on it."""
    family = socket.AF_INET6 if ":" in router.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a port in TIME_WAIT serves
    try:
        sock.bind((router.host, router.port))
    except OSError as e:
        sock.close()
        raise ValueError(f"--host {router.host} --port {router.port}: cannot listen there ({e.strerror}); "
                         "choose another --port") from None
    return sock


def make_logger(t0: float):
    return lambda msg: print(f"[pdserve {time.monotonic() - t0:5.1f}s] {msg}", file=sys.stderr, flush=True)


def _routers(config: ClusterConfig, model_paths: list[Path], control):
    """One Router per served model (config.model_clusters(), `model_paths` alike), each with
    its model's tokenizer and workers; the first has `control`."""
    from pdserve.common.model_files import served_model_name
    from pdserve.common.tokenizer import Tokenizer
    from pdserve.router.models import ModelRouters
    from pdserve.router.router import Router

    routers = []
    for i, (c, path) in enumerate(zip(config.model_clusters(), model_paths)):
        if not c.router.model_name:
            c = replace(c, router=replace(c.router, model_name=served_model_name(path)))
        routers.append(Router.from_config(c, Tokenizer.from_model_path(path), control=control if i == 0 else None))
    return ModelRouters(routers)


def serve_router(config: ClusterConfig, model_paths: list[Path], log, t0: float, sock: socket.socket,
                 control=None, api: bool = True) -> None:
    """Serve the OpenAI API on `sock` (`bind_api`'s) until Ctrl-C or SIGTERM; prints a ready
    `curl` line on stdout once the cluster can serve. `model_paths`: each served model's file (config.model_clusters()
    alike: one Router per model). `control`: the pools this process runs (for /admin/scale and the
    autoscaler). api=False (`pdserve up --no-router`): only /health and the admin endpoints;
    the router's view of the workers is still kept for the autoscaler (its latency signals
    stay empty: no traffic passes here, it sizes pools on queues, KV usage and refusals)."""
    from pdserve.router.app import create_admin_app, create_app

    rc, cache = config.router, config.engine.cache
    routers = _routers(config, model_paths, control)
    router = routers.first
    app = create_app(routers) if api else create_admin_app(control, config.security.api_keys)
    server = uvicorn.Server(uvicorn.Config(app, host=rc.host, port=rc.port, log_level="warning",
                                           timeout_graceful_shutdown=rc.shutdown_grace_s))  # Ctrl-C: then aborted

    async def announce():
        while not (server.started and routers.ready()):
            await asyncio.sleep(0.1)
        freeze_startup()  # full collections then skip the libraries, tokenizers and the app
        if not api:
            log(f"pools ready in {time.monotonic() - t0:.1f}s: {control.sizes()}; admin endpoints on "
                f"http://{rc.host}:{rc.port}/admin/pools")
            print(f"pools ready: {json.dumps(control.sizes())}", flush=True)
            return
        url = f"http://{rc.host}:{rc.port}"
        names = ", ".join(repr(n) for n in routers.routers)
        log(f"ready in {time.monotonic() - t0:.1f}s: {url}/v1 (model{'s' if routers.several else ''} {names})")
        stats = sorted((wid, s) for r in routers.routers.values() for wid, s in r.cluster.stats.items())
        log("KV caches: " + "; ".join(f"{wid} {s.kv_cache_dtype} {s.num_blocks} blocks ({s.num_blocks * cache.block_size} "
                                      f"tokens)" for wid, s in stats))
        auth = " -H 'Authorization: Bearer $PDSERVE_API_KEY'" if config.security.api_keys else ""
        print(f"curl {url}/v1/chat/completions{auth} -H 'Content-Type: application/json' -d "
              f"'{{\"model\": \"{router.model_name}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}]}}'",
              flush=True)

    async def serve():
        tasks = [asyncio.ensure_future(announce())] + ([] if api else [asyncio.ensure_future(routers.refresh_forever())])
        scale = config.autoscale
        if control is not None and scale.enabled:
            from .autoscale_loop import AutoscaleLoop, autoscaler_config

            loop = AutoscaleLoop(router, control, autoscaler_config(scale), log, scale.interval_s)
            tasks.append(asyncio.ensure_future(loop.run()))
            log("autoscaler on: " + ", ".join(f"{r} 1..{scale.max_replicas}" for r in control.pools))
        try:
            await server.serve(sockets=[sock])
        finally:
            await stop_tasks(*tasks)  # before asyncio.run's own single cancel, which a Redis call can drop
            for r in routers.routers.values():
                await asyncio.to_thread(r.tracer.shutdown)
            if not api:  # else the app's lifespan closes them
                await routers.close()

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled gracefully
        pass


def run_router(config: ClusterConfig) -> int:
    """`pdserve router`: serve against the cluster of `config.registry` until Ctrl-C."""
    from pdserve.common.model_files import resolve_model_path
    from pdserve.registry.urls import redact_url

    check_exposure(config.router, config.security)
    t0 = time.monotonic()
    log = make_logger(t0)
    with bind_api(config.router) as sock:
        log(f"router for cluster {config.registry.cluster_name!r} at {redact_url(config.registry.redis_url)}")
        serve_router(config, [resolve_model_path(c.engine.model or None) for c in config.model_clusters()], log, t0,
                     sock)
    log("stopped")
    return 0
