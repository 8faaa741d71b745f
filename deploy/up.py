"""`pdserve up`: the whole cluster on this machine (or on an existing Ray cluster) behind one
OpenAI endpoint: embedded Redis, Ray, a prefill pool and a decode pool, and the router in
this process. Ctrl-C stops everything it started, by PID or actor handle."""
from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time
import uuid

import uvicorn


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def served_model_name(path) -> str:
    return path.name.split(".")[0] if path.is_file() else path.name


def add_up_args(p) -> None:
    p.add_argument("--host", default="127.0.0.1", help="router bind address (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="router port (default: %(default)s)")
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (default: %(default)s)")
    p.add_argument("--decode", type=int, default=1, help="decode workers (default: %(default)s)")
    p.add_argument("--mode", choices=("disaggregated", "aggregated"), default="disaggregated",
                   help="aggregated: --decode workers that prefill themselves, no prefill pool")
    p.add_argument("--prefill-cpus", type=float, default=1.0, help="Ray CPUs per prefill worker")
    p.add_argument("--decode-cpus", type=float, default=1.0, help="Ray CPUs per decode worker")
    p.add_argument("--routing", choices=("prefix_aware", "round_robin", "least_loaded"), default="prefix_aware")
    p.add_argument("--ray-address", default="", help="join this Ray cluster instead of starting one")
    p.add_argument("--redis-url", default="", help="use this Redis instead of an embedded redis-server")
    p.add_argument("--cluster-name", default="", help="registry namespace (default: random)")
    p.add_argument("--cluster-token", default=os.environ.get("PDSERVE_CLUSTER_TOKEN", ""),
                   help="shared secret of the internal services (env PDSERVE_CLUSTER_TOKEN)")
    p.add_argument("--transfer-policy", choices=("recompute", "fail"), default="recompute",
                   help="when a KV hand-off fails: prefill on the decode worker, or fail the request")
    p.add_argument("--local-prefill-threshold", type=int, default=0,
                   help="prompts of at most this many tokens are prefilled on the decode worker")
    p.add_argument("--served-model-name", default="", help="model id in the API (default: from the file name)")
    p.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY", ""),
                   help="require 'Authorization: Bearer KEY' on /v1 (env PDSERVE_API_KEY); required when "
                        "--host is not a loopback address")
    p.add_argument("--max-inflight", type=int, default=256,
                   help="requests admitted at once; beyond it 429 with Retry-After (0: unbounded)")
    p.add_argument("--prefill-max-queue", type=int, default=64,
                   help="prompts queued per prefill worker before it refuses more (0: unbounded)")
    p.add_argument("--decode-max-queue", type=int, default=64,
                   help="requests waiting for their first token per decode worker before it refuses more "
                        "(0: unbounded); a request refused by every worker of a pool gets 429")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds before an unfinished request gets 504 and is aborted (0: none)")
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

    from engine.tokenizer import Tokenizer
    from engine.weights import resolve_model_path
    from router.app import Router, RouterConfig, create_app
    from router.cluster import ClusterClient
    from router.discovery import RegistryDiscovery

    from .cli import engine_config
    from .launch import Pool, PoolSpec
    from .redis_server import EmbeddedRedis
    from .registry import redact_url
    from .worker_host import WorkerSpec

    if args.host not in LOOPBACK and not args.api_key:
        raise ValueError(f"--host {args.host} exposes the API beyond this machine: set --api-key (or "
                         "PDSERVE_API_KEY) so that only clients with the key are served")
    t0 = time.monotonic()
    log = lambda msg: print(f"[pdserve {time.monotonic() - t0:5.1f}s] {msg}", file=sys.stderr, flush=True)
    engine_cfg = engine_config(args)
    model_path = resolve_model_path(engine_cfg.model or None)
    redis = None if args.redis_url else EmbeddedRedis().start()
    redis_url = args.redis_url or redis.url
    log(f"registry: {redact_url(redis_url)}" + (f" (embedded redis-server, pid {redis.pid})" if redis else ""))
    cluster_name = args.cluster_name or uuid.uuid4().hex[:8]
    if args.mode == "aggregated":
        pools = [PoolSpec("aggregated", args.decode, args.decode_cpus, max_queue=args.decode_max_queue)]
    else:
        pools = [PoolSpec("prefill", args.prefill, args.prefill_cpus, max_queue=args.prefill_max_queue),
                 PoolSpec("decode", args.decode, args.decode_cpus, max_queue=args.decode_max_queue)]
    started: list[Pool] = []
    try:
        _start_ray(args, sum(p.replicas * p.num_cpus for p in pools))
        log(f"ray: {ray.get_runtime_context().gcs_address}")
        base = WorkerSpec("", "", cluster_name, redis_url, args.cluster_token, "127.0.0.1", args.transfer_policy,
                          args.local_prefill_threshold, engine_cfg)
        started = [Pool(spec, base) for spec in pools]
        pending = [pool.launch() for pool in started]  # all pools load their model at once
        for pool, refs in zip(started, pending):
            for r in pool.wait(refs):
                log(f"{r['role']} worker {r['worker_id']} (pid {r['pid']}) on {r['address']}")
        client = ClusterClient(args.routing, engine_cfg.cache.block_size, engine_cfg.cache.cache_namespace,
                               args.cluster_token)
        router_cfg = RouterConfig(args.served_model_name or served_model_name(model_path), 0.25,
                                  (args.api_key,) if args.api_key else (), args.max_inflight, args.request_timeout)
        router = Router(client, Tokenizer.from_model_path(model_path), router_cfg,
                        discovery=RegistryDiscovery(redis_url, cluster_name, client))
        server = uvicorn.Server(uvicorn.Config(create_app(router), host=args.host, port=args.port, log_level="warning"))

        async def announce():
            while not (server.started and client.ready()):
                await asyncio.sleep(0.1)
            url = f"http://{args.host}:{args.port}"
            log(f"ready in {time.monotonic() - t0:.1f}s: {url}/v1 (model {router.model_name!r})")
            auth = " -H 'Authorization: Bearer $PDSERVE_API_KEY'" if args.api_key else ""
            print(f"curl {url}/v1/chat/completions{auth} -H 'Content-Type: application/json' -d "
                  f"'{{\"model\": \"{router.model_name}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}]}}'",
                  flush=True)

        async def serve():
            task = asyncio.ensure_future(announce())
            try:
                await server.serve()
            finally:
                task.cancel()

        try:
            asyncio.run(serve())
        except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled gracefully
            pass
        return 0
    finally:
        log("shutting down")
        for pool in reversed(started):
            pool.stop()
        if ray.is_initialized():
            ray.shutdown()
        if redis is not None:
            redis.stop()
        log("stopped")
