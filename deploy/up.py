"""`pdserve up`: the whole cluster on this machine (or on an existing Ray cluster) behind one
OpenAI endpoint: embedded Redis, Ray, a prefill pool and a decode pool, and the router in
this process. A cluster that cannot be placed on Ray is refused before any worker starts
(placement.py); Ctrl-C or SIGTERM in any phase, start included, stops everything it started,
by PID or actor handle (interrupts.py)."""
from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace

from pdserve.config import ClusterConfig

from .router_server import bind_api, check_exposure, make_logger, serve_router


class PlacementError(ValueError):
    """The pools ask for more than the Ray cluster has: the message says what, and the flags
    that give room."""


def _start_ray(ray_address: str, cpus: int):
    """Join `ray_address`, or start a private local Ray of `cpus` CPUs. Returns the GCS
    address and the session directory of the local Ray (None when joining)."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # Ray starts its workers at nice 15 by default: beside any ordinary process on the host
    # (a build, a test run) the serving workers then get a few percent of a core and every
    # deadline expires. A local Ray of ours runs them at the caller's priority.
    os.environ.setdefault("RAY_worker_niceness", "0")
    if ray_address:
        ray.init(address=ray_address, log_to_driver=False)
        return ray.get_runtime_context().gcs_address, None
    temp = tempfile.mkdtemp(prefix="pdserve-ray-")
    ray.init(num_cpus=cpus, include_dashboard=False, object_store_memory=128 << 20, _temp_dir=temp,
             log_to_driver=False)
    return ray.get_runtime_context().gcs_address, temp


def _embedded_redis(config: ClusterConfig):
    """The cluster's registry when none is given: a redis-server with a password (the
    config's, else random per cluster; the URL the workers get carries it), on loopback, or,
    when joining a Ray cluster whose other nodes must reach it, on this node's address."""
    from pdserve.registry.embedded import EmbeddedRedis

    password = config.redis_password or secrets.token_urlsafe(24)
    if not config.ray_address:
        return EmbeddedRedis(password=password).start()
    import ray
    return EmbeddedRedis(host=ray.util.get_node_ip_address(), password=password).start()


def _check_degrees(clusters: list[ClusterConfig], paths: list) -> None:
    """Refuse at once, before Ray starts, a pool's tensor-, expert- or pipeline-parallel degree
    its model cannot be split into (the model's config read from its directory or GGUF header,
    only where a degree is above 1), naming the pool's flag and the degrees that fit."""
    from pdserve.engine.model.gguf_config import read_model_config
    from pdserve.engine.parallel.degrees import check_degree, check_experts, check_stages

    for c, path in zip(clusters, paths):
        e = c.engine
        degrees = {role: (pool.tp or e.tensor_parallel_size, pool.ep or e.expert_parallel_size,
                          pool.pp or e.pipeline_parallel_size) for role, pool in c.pools().items()}
        if all(d == (1, 1, 1) for d in degrees.values()):
            continue  # one rank a worker: nothing to split (the model is read where it loads)
        cfg = read_model_config(path)
        for role, (tp, ep, pp) in degrees.items():
            split = c.pools()[role].pp_layers or e.pipeline_layers
            checks = [("ep", check_experts, ep)] if ep > 1 else []  # a dense model is refused any ep
            checks += [("pp", check_stages, pp), ("tp", check_degree, tp)]
            if split:  # the stages' layer counts, once the degree fits
                checks.append(("pp-layers", lambda cfg, d, split=split: check_stages(cfg, d, split), pp))
            for flag, check, degree in checks:
                try:
                    check(cfg, degree)
                except ValueError as err:
                    raise ValueError(f"--{role}-{flag}: {err}") from None


def _check_local_fit(config: ClusterConfig, cpus: int) -> None:
    """Raise PlacementError before a local Ray of `cpus` CPUs starts when the pools' CPUs do not
    fit in it. Pools that ask for GPUs or custom resources are left to `_check_placement`:
    what a local Ray has of those is known once it runs."""
    from .placement import RayResources, cluster_demands, placement_shortfall

    demands = cluster_demands(config)
    if any(set(d.per_worker) - {"CPU"} for d in demands):
        return
    has = {"CPU": float(cpus)}
    short = placement_shortfall(demands, RayResources(has, has, [has]))
    if short is not None:
        raise PlacementError(f"the pools do not fit in the local Ray cluster: {short}")


def _check_placement(config: ClusterConfig, log) -> None:
    """Raise PlacementError at once when the pools cannot fit in the local Ray (Ray would keep
    them pending for good, silently). A joined cluster may grow (an autoscaler adds nodes for
    pending work): there the shortfall is logged and the pools wait."""
    from .placement import cluster_demands, placement_shortfall, ray_resources

    short = placement_shortfall(cluster_demands(config), ray_resources(), local=not config.ray_address)
    if short is None:
        return
    if not config.ray_address:
        raise PlacementError(f"the pools do not fit in the local Ray cluster: {short}")
    log(f"the pools do not fit in the Ray cluster now; they wait for room (an autoscaler's new nodes): {short}")


def _log_registry(config: ClusterConfig, redis, log) -> None:
    from pdserve.registry.urls import redact_url

    registry = config.registry
    log(f"registry: {redact_url(registry.redis_url)}"
        + (f" (embedded redis-server, pid {redis.pid})" if redis else ""))
    log(f"cluster name: {registry.cluster_name} (`pdserve router --redis-url URL --cluster-name "
        f"{registry.cluster_name} --cluster-token TOKEN` adds a router; the URL's password and the token are "
        "random unless given: --redis-password and --cluster-token)")


def _start_pools(config: ClusterConfig, up: "_Started", log) -> None:
    """Start every pool of every served model (in `up.pools`, so a cut start stops them): all
    load their model at once; returns once every worker has started."""
    from .launch import Pool

    prefix = (lambda c: f"{c.router.model_name}-") if config.models else (lambda c: "")
    up.pools = [Pool(role, c, prefix(c)) for c in config.model_clusters() for role in c.pools()]
    pending = [pool.launch() for pool in up.pools]
    for pool, refs in zip(up.pools, pending):
        for r in pool.wait(refs, log):
            log(f"{r['role']} worker {r['worker_id']} (pid {r['pid']}) on {r['address']}")
            if r.get("registry_error"):
                log(f"{r['worker_id']} cannot reach the registry yet ({r['registry_error']}); it joins the "
                    "cluster once it can")


@dataclass
class _Started:
    """What this `pdserve up` has started so far: what its cleanup stops."""
    pools: list = field(default_factory=list)
    supervisor: threading.Thread | None = None
    stopping: threading.Event = field(default_factory=threading.Event)
    redis: object = None
    ray_temp: str | None = None


def run_up(config: ClusterConfig, api: bool = True) -> int:
    """Run the cluster until Ctrl-C or SIGTERM. api=False (`--no-router`): the pools and their
    admin endpoints only; routers run elsewhere. A signal in any phase, start included, stops
    everything started so far (deploy/interrupts.py); a start cut short raises
    KeyboardInterrupt once it is cleaned up."""
    from pdserve.common.model_files import resolve_model_path

    from .interrupts import Interrupts
    from .placement import local_ray_cpus

    check_exposure(config.router, config.security)
    t0 = time.monotonic()
    log = make_logger(t0)
    clusters = config.model_clusters()  # one per served model (one: the cluster's own engine and pools)
    paths = [resolve_model_path(c.engine.model or None) for c in clusters]
    _check_degrees(clusters, paths)
    cpus = local_ray_cpus(config, os.cpu_count() or 1)
    if not config.ray_address:
        _check_local_fit(config, cpus)
    from .launch import RayPools  # Ray and the workers' code: imported once the flags are known to fit

    sock = bind_api(config.router)  # held from here: nothing started below can take the port
    up, clean = _Started(), False
    interrupts = Interrupts(log).install()
    try:
        log(f"joining Ray at {config.ray_address}" if config.ray_address else f"starting a local Ray of {cpus} CPUs")
        with interrupts.deferred():  # cut half-way, ray.init leaves processes behind that nothing stops
            gcs, up.ray_temp = _start_ray(config.ray_address, cpus)
        interrupts.install()  # ray.init set its own SIGTERM handler
        with interrupts.deferred():
            up.redis = None if config.registry.redis_url else _embedded_redis(config)
        if up.redis is not None:
            config = replace(config, registry=replace(config.registry, redis_url=up.redis.url))
        _log_registry(config, up.redis, log)
        log(f"ray: {gcs}" + (f" (session files in {up.ray_temp})" if up.ray_temp else ""))
        _check_placement(config, log)
        _start_pools(config, up, log)

        def supervise():  # brings restarted actors back into service
            while not up.stopping.wait(1.0):
                for pool in up.pools:
                    for note in pool.supervise_once():
                        log(note)
        up.supervisor = threading.Thread(target=supervise, name="pool-supervisor", daemon=True)
        up.supervisor.start()
        # /admin/scale and the autoscaler act on the first model's pools
        serve_router(config, paths, log, t0, sock, control=RayPools(up.pools[:len(clusters[0].pools())], log), api=api)
        clean = True
        return 0
    except (KeyboardInterrupt, PlacementError):
        clean = True  # Ray's logs hold nothing to read on what stopped it
        raise
    finally:
        with interrupts.shielded():
            _stop_all(up, config.router.shutdown_grace_s, clean, log)
        sock.close()
        interrupts.restore()


def _stop_all(up: _Started, grace_s: float, clean: bool, log) -> None:
    """Stop what `up` holds, newest first: the workers (`grace_s` to finish), Ray, Redis."""
    import ray

    from .launch import stop_pools

    log("shutting down")
    if up.supervisor is not None:
        up.stopping.set()
        up.supervisor.join(timeout=5)
    stop_pools(up.pools, grace_s)
    if ray.is_initialized():
        ray.shutdown()
    if up.ray_temp:  # Ray's session files and logs: kept (and named) only when something failed
        if clean:
            shutil.rmtree(up.ray_temp, ignore_errors=True)
        else:
            log(f"ray logs kept in {up.ray_temp}")
    if up.redis is not None:
        up.redis.stop()
    log("stopped")
