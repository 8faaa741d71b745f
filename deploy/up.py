"""`pdserve up`: the whole cluster on this machine (or on an existing Ray cluster) behind one
OpenAI endpoint: embedded Redis, Ray, a prefill pool and a decode pool, and the router in
this process. Ctrl-C stops everything it started, by PID or actor handle."""
from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
import uuid
from dataclasses import replace

from .router_server import add_router_args, check_exposure, make_logger, serve_router, tls_config


def add_up_args(p) -> None:
    add_router_args(p)
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (default: %(default)s)")
    p.add_argument("--decode", type=int, default=1, help="decode workers (default: %(default)s)")
    p.add_argument("--mode", choices=("disaggregated", "aggregated"), default="disaggregated",
                   help="aggregated: --decode workers that prefill themselves, no prefill pool")
    p.add_argument("--prefill-cpus", type=float, default=1.0, help="Ray CPUs per prefill worker")
    p.add_argument("--decode-cpus", type=float, default=1.0, help="Ray CPUs per decode worker")
    p.add_argument("--prefill-gpus", type=float, default=0.0, help="GPUs per prefill worker (with --device cuda)")
    p.add_argument("--decode-gpus", type=float, default=0.0, help="GPUs per decode worker (with --device cuda)")
    p.add_argument("--prefill-resource", default="", help="custom Ray resource each prefill worker takes 1 of "
                   "(e.g. the one a KubeRay worker group advertises): places the pool on those nodes")
    p.add_argument("--decode-resource", default="", help="the same for decode workers")
    p.add_argument("--autoscale", action="store_true",
                   help="size each pool from its own signals (prefill: queued tokens, TTFT; decode: KV usage, ITL)")
    p.add_argument("--autoscale-max", type=int, default=4, help="most workers per pool when autoscaling")
    p.add_argument("--ttft-slo", type=float, default=2.0, help="TTFT p90 target of the autoscaler (s)")
    p.add_argument("--itl-slo", type=float, default=0.1, help="ITL p90 target of the autoscaler (s)")
    p.add_argument("--autoscale-interval", type=float, default=5.0, help="seconds between autoscaler rounds")
    p.add_argument("--autoscale-up-after", type=float, default=30.0,
                   help="a pool overloaded this long (s, continuously) grows")
    p.add_argument("--autoscale-down-after", type=float, default=300.0,
                   help="a pool underused this long (s, continuously) shrinks")
    p.add_argument("--autoscale-cooldown", type=float, default=60.0, help="seconds between two changes of a pool")
    p.add_argument("--no-router", action="store_true",
                   help="run the pools only (routers run elsewhere: `pdserve router`); --port then serves "
                        "/health and the admin endpoints")
    p.add_argument("--ray-address", default="", help="join this Ray cluster instead of starting one")
    p.add_argument("--worker-host", default="", help="address workers serve on: 'auto' (their node's IP, the "
                   "default with --ray-address) or an address (default without: 127.0.0.1)")
    p.add_argument("--redis-url", default=os.environ.get("PDSERVE_REDIS_URL", ""),
                   help="use this Redis instead of an embedded redis-server (env PDSERVE_REDIS_URL, which keeps a "
                        "password out of `ps`)")
    p.add_argument("--cluster-name", default="", help="registry namespace (default: random)")
    p.add_argument("--kv-transport", choices=("grpc", "ucx"), default="grpc",
                   help="how decode workers receive KV: grpc, or ucx (pip install 'pdserve[ucx]'; RDMA/NVLink/"
                        "shared memory where present, TCP elsewhere)")
    p.add_argument("--kv-layer-group", type=int, default=0,
                   help="prefill workers push a prompt's KV every N layers as they are computed, overlapping "
                        "transfer with compute (0: all layers at the end)")
    p.add_argument("--transfer-policy", choices=("recompute", "fail"), default="recompute",
                   help="when a KV hand-off fails: prefill on the decode worker, or fail the request")
    p.add_argument("--local-prefill-threshold", type=int, default=0,
                   help="prompts of at most this many tokens are prefilled on the decode worker")
    p.add_argument("--prefill-max-queue", type=int, default=64,
                   help="prompts queued per prefill worker before it refuses more (0: unbounded)")
    p.add_argument("--decode-max-queue", type=int, default=64,
                   help="requests waiting for their first token per decode worker before it refuses more "
                        "(0: unbounded); a request refused by every worker of a pool gets 429")
    p.add_argument("--max-restarts", type=int, default=10,
                   help="Ray restarts a dead worker up to this many times; it re-registers (-1: always)")
    p.set_defaults(func=cmd_up)


def _start_ray(args, needed_cpus: float):
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if args.ray_address:
        ray.init(address=args.ray_address, log_to_driver=False)
        return None
    temp = tempfile.mkdtemp(prefix="pdserve-ray-")
    ray.init(num_cpus=max(os.cpu_count() or 1, int(needed_cpus + 0.999)), include_dashboard=False,
             object_store_memory=128 << 20, _temp_dir=temp, log_to_driver=False)
    return temp


def cmd_up(args) -> int:
    import ray

    from pdserve.engine.weights import resolve_model_path

    from .cli import engine_config
    from .launch import Pool, PoolControl, PoolSpec
    from .redis_server import EmbeddedRedis
    from .registry import redact_url
    from .worker_host import WorkerSpec

    check_exposure(args)
    tls = tls_config(args)
    t0 = time.monotonic()
    log = make_logger(t0)
    engine_cfg = engine_config(args)
    model_path = resolve_model_path(engine_cfg.model or None)
    redis = None if args.redis_url else EmbeddedRedis().start()
    redis_url = args.redis_url or redis.url
    log(f"registry: {redact_url(redis_url)}" + (f" (embedded redis-server, pid {redis.pid})" if redis else ""))
    cluster_name = args.cluster_name or uuid.uuid4().hex[:8]
    log(f"cluster name: {cluster_name} (`pdserve router --redis-url URL --cluster-name {cluster_name}` adds a router)")
    decode = PoolSpec("decode", args.decode, args.decode_cpus, args.decode_gpus, args.decode_max_queue,
                      args.max_restarts, args.decode_resource)
    if args.mode == "aggregated":
        pools = [replace(decode, role="aggregated")]
    else:
        pools = [PoolSpec("prefill", args.prefill, args.prefill_cpus, args.prefill_gpus, args.prefill_max_queue,
                          args.max_restarts, args.prefill_resource), decode]
    started: list[Pool] = []
    supervisor = None
    ray_temp, clean = None, False
    try:
        ray_temp = _start_ray(args, sum(p.replicas * p.num_cpus for p in pools))
        log(f"ray: {ray.get_runtime_context().gcs_address}" + (f" (session files in {ray_temp})" if ray_temp else ""))
        worker_host = args.worker_host or ("auto" if args.ray_address else "127.0.0.1")
        base = WorkerSpec("", "", cluster_name, redis_url, args.cluster_token, worker_host, args.transfer_policy,
                          args.local_prefill_threshold, tls=tls, kv_transport=args.kv_transport,
                          kv_layer_group=args.kv_layer_group, engine=engine_cfg)
        started = [Pool(spec, base) for spec in pools]
        pending = [pool.launch() for pool in started]  # all pools load their model at once
        for pool, refs in zip(started, pending):
            for r in pool.wait(refs):
                log(f"{r['role']} worker {r['worker_id']} (pid {r['pid']}) on {r['address']}")
        stopping = threading.Event()

        def supervise():  # brings restarted actors back into service
            while not stopping.wait(1.0):
                for pool in started:
                    for note in pool.supervise_once():
                        log(note)
        supervisor = threading.Thread(target=supervise, name="pool-supervisor", daemon=True)
        supervisor.start()
        control = PoolControl(started, log)
        serve_router(args, model_path, engine_cfg.cache.block_size, engine_cfg.cache.cache_namespace, redis_url,
                     cluster_name, log, t0, control=control, api=not args.no_router)
        clean = True
        return 0
    finally:
        log("shutting down")
        if supervisor is not None:
            stopping.set()
            supervisor.join(timeout=10)
        for pool in reversed(started):
            pool.stop()
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
