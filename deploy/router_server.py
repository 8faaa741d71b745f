"""The router as a process: `pdserve up` runs it next to its pools, and `pdserve router`
runs it alone against a running cluster's registry (more routers, or a restarted one: it
keeps no state of its own, so a new router serves as soon as it has read the registry)."""
from __future__ import annotations

import asyncio
import json
import os
import sys
import time

import uvicorn

from pdserve.engine.aio import stop_tasks

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def served_model_name(path) -> str:
    return path.name.split(".")[0] if path.is_file() else path.name


def add_router_args(p) -> None:
    """Flags of the HTTP front end, shared by `pdserve up` and `pdserve router`."""
    p.add_argument("--host", default="127.0.0.1", help="router bind address (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="router port (default: %(default)s)")
    p.add_argument("--routing", choices=("prefix_aware", "round_robin", "least_loaded"), default="prefix_aware")
    p.add_argument("--decode-local-prefill", type=int, default=64, metavar="TOKENS",
                   help="a decode worker prefills a prompt itself when at most TOKENS of it are not in its own "
                        "cache (a short prompt, or one whose prefix it holds): no prefill worker, no KV transfer "
                        "(0: every prompt through the prefill pool; default: %(default)s)")
    p.add_argument("--cluster-token", default=os.environ.get("PDSERVE_CLUSTER_TOKEN", ""),
                   help="shared secret of the internal services (env PDSERVE_CLUSTER_TOKEN)")
    p.add_argument("--served-model-name", default="", help="model id in the API (default: from the file name)")
    p.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY", ""),
                   help="require 'Authorization: Bearer KEY' on /v1 (env PDSERVE_API_KEY); required when "
                        "--host is not a loopback address")
    g = p.add_argument_group("internal TLS (mutual TLS between router and workers; all three files, or none)")
    g.add_argument("--tls-cert", default=os.environ.get("PDSERVE_TLS_CERT", ""), help="certificate chain, PEM")
    g.add_argument("--tls-key", default=os.environ.get("PDSERVE_TLS_KEY", ""), help="its private key, PEM")
    g.add_argument("--tls-ca", default=os.environ.get("PDSERVE_TLS_CA", ""), help="the cluster CA, PEM")
    g.add_argument("--tls-server-name", default=os.environ.get("PDSERVE_TLS_SERVER_NAME", ""),
                   help="name to verify in the workers' certificates (default: the address dialled)")
    p.add_argument("--max-inflight", type=int, default=256,
                   help="requests admitted at once; beyond it 429 with Retry-After (0: unbounded)")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds before an unfinished request gets 504 and is aborted (0: none)")


def check_exposure(args) -> None:
    if args.host not in LOOPBACK and not args.api_key:
        raise ValueError(f"--host {args.host} exposes the API beyond this machine: set --api-key (or "
                         "PDSERVE_API_KEY) so that only clients with the key are served")


def tls_config(args):
    """The internal TLS settings from the flags, checked now (not on the first request)."""
    from pdserve.protos.security import TLSConfig

    tls = TLSConfig(args.tls_cert, args.tls_key, args.tls_ca, args.tls_server_name)
    if tls.enabled:
        tls.server_credentials()  # raises TLSConfigError (a ValueError) naming what is missing
    return tls


def make_logger(t0: float):
    return lambda msg: print(f"[pdserve {time.monotonic() - t0:5.1f}s] {msg}", file=sys.stderr, flush=True)


def serve_router(args, model_path, block_size: int, namespace: str, redis_url: str, cluster_name: str,
                 log, t0: float, control=None, api: bool = True) -> None:
    """Serve the OpenAI API until Ctrl-C or SIGTERM; prints a ready `curl` line on stdout once
    the cluster can serve. `control`: the pools this process runs (for /admin/scale and the
    autoscaler). api=False (`pdserve up --no-router`): only /health and the admin endpoints;
    the router's view of the workers is still kept for the autoscaler (its latency signals
    stay empty: no traffic passes here, it sizes pools on queues, KV usage and refusals)."""
    from pdserve.engine.tokenizer import Tokenizer
    from pdserve.router.app import Router, RouterConfig, create_admin_app, create_app
    from pdserve.router.cluster import ClusterClient
    from pdserve.router.discovery import RegistryDiscovery

    client = ClusterClient(args.routing, block_size, namespace, args.cluster_token, tls=tls_config(args),
                           local_prefill_tokens=args.decode_local_prefill)
    router_cfg = RouterConfig(args.served_model_name or served_model_name(model_path), 0.25,
                              (args.api_key,) if args.api_key else (), args.max_inflight, args.request_timeout)
    router = Router(client, Tokenizer.from_model_path(model_path), router_cfg,
                    discovery=RegistryDiscovery(redis_url, cluster_name, client))
    router.control = control
    app = create_app(router) if api else create_admin_app(control, router_cfg.api_keys)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                           timeout_graceful_shutdown=30))  # Ctrl-C: streams get 30 s to finish

    async def watch():  # what create_app's lifespan does for the API: keep the view of the workers fresh
        while True:
            await router.discovery.sync()
            await client.refresh()
            await asyncio.sleep(router.refresh_interval_s)

    async def announce():
        while not (server.started and client.ready()):
            await asyncio.sleep(0.1)
        if not api:
            log(f"pools ready in {time.monotonic() - t0:.1f}s: {control.sizes()}; admin endpoints on "
                f"http://{args.host}:{args.port}/admin/pools")
            print(f"pools ready: {json.dumps(control.sizes())}", flush=True)
            return
        url = f"http://{args.host}:{args.port}"
        log(f"ready in {time.monotonic() - t0:.1f}s: {url}/v1 (model {router.model_name!r})")
        auth = " -H 'Authorization: Bearer $PDSERVE_API_KEY'" if args.api_key else ""
        print(f"curl {url}/v1/chat/completions{auth} -H 'Content-Type: application/json' -d "
              f"'{{\"model\": \"{router.model_name}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}]}}'",
              flush=True)

    async def serve():
        tasks = [asyncio.ensure_future(announce())] + ([] if api else [asyncio.ensure_future(watch())])
        if control is not None and getattr(args, "autoscale", False):
            from .autoscale_loop import AutoscaleLoop, autoscaler_config

            loop = AutoscaleLoop(router, control, autoscaler_config(args), log, args.autoscale_interval)
            tasks.append(asyncio.ensure_future(loop.run()))
            log("autoscaler on: " + ", ".join(f"{r} 1..{args.autoscale_max}" for r in control.pools))
        try:
            await server.serve()
        finally:
            await stop_tasks(*tasks)  # before asyncio.run's own single cancel, which a Redis call can drop
            if not api:
                await client.close()
                await router.discovery.close()

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled gracefully
        pass


def add_router_cmd_args(p) -> None:
    add_router_args(p)
    p.add_argument("--redis-url", default=os.environ.get("PDSERVE_REDIS_URL", ""),
                   help="the cluster's registry (see `pdserve up`'s log; env PDSERVE_REDIS_URL)")
    p.add_argument("--cluster-name", required=True, help="the cluster's registry namespace")
    p.add_argument("--model", default="", help="the cluster's model file or directory (for the tokenizer)")
    p.add_argument("--block-size", type=int, default=16, help="the workers' KV block size (prefix hashing)")
    p.set_defaults(func=cmd_router)


def cmd_router(args) -> int:
    from pdserve.engine.config import CacheConfig
    from pdserve.engine.weights import resolve_model_path

    from .registry import redact_url

    check_exposure(args)
    if not args.redis_url:
        raise ValueError("pdserve router needs the cluster's registry: --redis-url (or PDSERVE_REDIS_URL)")
    t0 = time.monotonic()
    log = make_logger(t0)
    log(f"router for cluster {args.cluster_name!r} at {redact_url(args.redis_url)}")
    serve_router(args, resolve_model_path(args.model or None), args.block_size, CacheConfig().cache_namespace,
                 args.redis_url, args.cluster_name, log, t0)
    log("stopped")
    return 0


def add_scale_args(p) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the `pdserve up` whose pools to resize")
    p.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY", ""), help="(env PDSERVE_API_KEY)")
    p.add_argument("--prefill", type=int, default=None, help="prefill workers wanted")
    p.add_argument("--decode", type=int, default=None, help="decode workers wanted")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait (removed workers drain first)")
    p.set_defaults(func=cmd_scale)


def cmd_scale(args) -> int:
    """POST /admin/scale; prints the pool sizes once new workers serve and removed ones drained."""
    import json
    import urllib.error
    import urllib.request

    sizes = {k: v for k, v in (("prefill", args.prefill), ("decode", args.decode)) if v is not None}
    if not sizes:
        raise ValueError("say what to scale: --prefill N and/or --decode M")
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {args.api_key}"} if args.api_key else {})
    req = urllib.request.Request(args.url.rstrip("/") + "/admin/scale", json.dumps(sizes).encode(), headers)
    try:
        with urllib.request.urlopen(req, timeout=args.timeout) as r:
            print(json.dumps(json.loads(r.read())["pools"]))
        return 0
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")
        try:
            detail = json.loads(detail)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            pass
        print(f"pdserve scale: {e.code}: {detail}", file=sys.stderr)
        return 1
    except urllib.error.URLError as e:
        print(f"pdserve scale: cannot reach {args.url}: {e.reason}", file=sys.stderr)
        return 1
