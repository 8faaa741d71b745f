"""`pdserve up`: the whole cluster on this machine (or on an existing Ray cluster) behind one
OpenAI endpoint: embedded Redis, Ray, a prefill pool and a decode pool, and the router in
this process. Ctrl-C stops everything it started, by PID or actor handle."""
from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import threading
import time
from dataclasses import replace

from pdserve.config import ClusterConfig

from .router_server import check_exposure, make_logger, serve_router


def _start_ray(ray_address: str, needed_cpus: float, ray_cpus: float = 0.0):
    """Join `ray_address`, or start a private local Ray. Returns the GCS address and the
    session directory of the local Ray (None when joining)."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if ray_address:
        ray.init(address=ray_address, log_to_driver=False)
        return ray.get_runtime_context().gcs_address, None
    temp = tempfile.mkdtemp(prefix="pdserve-ray-")
    cpus = max(ray_cpus or os.cpu_count() or 1, needed_cpus)
    ray.init(num_cpus=int(cpus + 0.999), include_dashboard=False,
             object_store_memory=128 << 20, _temp_dir=temp, log_to_driver=False)
    return ray.get_runtime_context().gcs_address, temp


def _embedded_redis(ray_address: str):
    """The cluster's registry when none is given: a redis-server on loopback, or, when joining
    a Ray cluster whose other nodes must reach it, on this node's address with a random
    password (the URL the workers get carries it)."""
    from pdserve.registry.embedded import EmbeddedRedis

    if not ray_address:
        return EmbeddedRedis().start()
    import ray
    return EmbeddedRedis(host=ray.util.get_node_ip_address(), password=secrets.token_urlsafe(24)).start()


def run_up(config: ClusterConfig, api: bool = True) -> int:
    """Run the cluster until Ctrl-C or SIGTERM. api=False (`--no-router`): the pools and their
    admin endpoints only; routers run elsewhere."""
    import ray

    from pdserve.engine.model.weights import resolve_model_path
    from pdserve.registry.urls import redact_url

    from .launch import Pool, RayPools, stop_pools

    check_exposure(config.router, config.security)
    t0 = time.monotonic()
    log = make_logger(t0)
    model_path = resolve_model_path(config.engine.model or None)
    started: list[Pool] = []
    supervisor, redis = None, None
    ray_temp, clean = None, False
    try:
        gcs, ray_temp = _start_ray(config.ray_address, sum(p.replicas * p.num_cpus for p in config.pools().values()),
                              config.ray_cpus)
        redis = None if config.registry.redis_url else _embedded_redis(config.ray_address)
        if redis is not None:
            config = replace(config, registry=replace(config.registry, redis_url=redis.url))
        registry = config.registry
        log(f"registry: {redact_url(registry.redis_url)}"
            + (f" (embedded redis-server, pid {redis.pid})" if redis else ""))
        log(f"cluster name: {registry.cluster_name} (`pdserve router --redis-url URL --cluster-name "
            f"{registry.cluster_name} --cluster-token TOKEN` adds a router; without --cluster-token this cluster's "
            "token is random)")
        log(f"ray: {gcs}" + (f" (session files in {ray_temp})" if ray_temp else ""))
        started = [Pool(role, config) for role in config.pools()]
        pending = [pool.launch() for pool in started]  # all pools load their model at once
        for pool, refs in zip(started, pending):
            for r in pool.wait(refs):
                log(f"{r['role']} worker {r['worker_id']} (pid {r['pid']}) on {r['address']}")
                if r.get("registry_error"):
                    log(f"{r['worker_id']} cannot reach the registry yet ({r['registry_error']}); it joins the "
                        "cluster once it can")
        stopping = threading.Event()

        def supervise():  # brings restarted actors back into service
            while not stopping.wait(1.0):
                for pool in started:
                    for note in pool.supervise_once():
                        log(note)
        supervisor = threading.Thread(target=supervise, name="pool-supervisor", daemon=True)
        supervisor.start()
        control = RayPools(started, log)
        serve_router(config, model_path, log, t0, control=control, api=api)
        clean = True
        return 0
    finally:
        log("shutting down")
        if supervisor is not None:
            stopping.set()
            supervisor.join(timeout=5)
        stop_pools(started, config.router.shutdown_grace_s)
        if ray.is_initialized():
            ray.shutdown()
        if ray_temp:  # Ray's session files and logs: kept (and named) only when something failed
            if clean:
                shutil.rmtree(ray_temp, ignore_errors=True)
            else:
                log(f"ray logs kept in {ray_temp}")
        if redis is not None:
            redis.stop()
        log("stopped")
