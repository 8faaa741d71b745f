"""The cluster commands' flags (`pdserve up`, `router`, `worker`, `scale`) and the one place
they, and the environment, become the typed config tree of `pdserve.config`. Defaults are
the config's own, so that a flag and the field it sets cannot disagree."""
from __future__ import annotations

import argparse
import os
import secrets
import uuid
from dataclasses import replace

from pdserve.config import (
    KV_DTYPE_MISMATCH,
    KV_TRANSPORTS,
    KV_WIRE_DTYPES,
    MODES,
    ROLES,
    ROUTING_POLICIES,
    TRANSFER_POLICIES,
    AutoscaleConfig,
    ClusterConfig,
    PoolConfig,
    RegistryConfig,
    RouterConfig,
    SecurityConfig,
    TracingConfig,
    TransferConfig,
    WorkerConfig,
    layer_counts,
)
from pdserve.engine.core.arg_utils import engine_config
from pdserve.engine.config import KV_CACHE_DTYPES, CacheConfig, EngineConfig, LoRAConfig, parse_size
from pdserve.protos.security import TLSConfig

_R, _P, _T, _A, _L = RouterConfig(), PoolConfig(), TransferConfig(), AutoscaleConfig(), LoRAConfig()
_W = WorkerConfig(role="decode", worker_id="")


def _env(name: str) -> str:
    return os.environ.get(name, "")


def add_router_args(p: argparse.ArgumentParser) -> None:
    """Flags of the HTTP front end, shared by `pdserve up` and `pdserve router`."""
    p.add_argument("--host", default=_R.host, help="router bind address (default: %(default)s)")
    p.add_argument("--port", type=int, default=_R.port, help="router port (default: %(default)s)")
    p.add_argument("--routing", choices=ROUTING_POLICIES, default=_R.routing)
    p.add_argument("--decode-local-prefill", type=int, default=_R.decode_local_prefill, metavar="TOKENS",
                   help="a decode worker prefills a prompt itself when at most TOKENS of it are not in its own "
                        "cache (a short prompt, or one whose prefix it holds): no prefill worker, no KV transfer "
                        "(0: every prompt through the prefill pool; default: %(default)s)")
    p.add_argument("--prefill-queue-limit", type=int, default=_R.prefill_queue_limit, metavar="TOKENS",
                   help="once the prefill worker has TOKENS prompt tokens queued, a prompt that would wait less "
                        "on its decode worker is prefilled there, so neither pool idles while the other is "
                        "saturated (0: always the prefill pool; default: %(default)s)")
    p.add_argument("--hold-tokens", type=int, default=_R.hold_tokens, metavar="TOKENS",
                   help="while every prefill worker has TOKENS prompt tokens queued and no decode worker would "
                        "take a prompt, the router holds it until a place opens (0: route every prompt at once; "
                        "default: %(default)s)")
    p.add_argument("--no-idle-decode-prefill", dest="idle_decode_prefill", action="store_false",
                   help="send prompts to the prefill pool even when their decode worker is idle (default: an "
                        "idle decode worker prefills the prompt itself, skipping the KV hand-off)")
    p.add_argument("--urgent-lend-window", type=float, default=_R.urgent_lend_window_s, metavar="SECONDS",
                   help="no less urgent prompt is lent to a decode worker that streamed for a more urgent request "
                        "within SECONDS (0: only while it streams for one; default: %(default)s)")
    p.add_argument("--special-tokens-in-content", action="store_true",
                   help="encode control-token text typed inside chat messages (<|im_start|>...) as control tokens "
                        "(default: as plain text, so a user cannot forge a system or assistant turn)")
    p.add_argument("--cluster-token", default=_env("PDSERVE_CLUSTER_TOKEN"),
                   help="shared secret of the internal services, checked on every RPC (env PDSERVE_CLUSTER_TOKEN; "
                        "`pdserve up` makes a random one per cluster when none is given; workers serving on a "
                        "network address refuse to start without one)")
    p.add_argument("--served-model-name", default="", help="model id in the API (default: from the file name)")
    p.add_argument("--api-key", default=_env("PDSERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (env PDSERVE_API_KEY); this key or a keys "
                        "file is required when --host is not a loopback address")
    p.add_argument("--keys-file", default=_env("PDSERVE_KEYS_FILE"),
                   help="the operator's API keys (TOML, router/keys.py): each key's sha256 digest, tenant, "
                        "priority_ceiling, over_ceiling, models, trusted and rate limits, and [tenants.NAME] "
                        "limits; reloaded when it changes or on SIGHUP (env PDSERVE_KEYS_FILE)")
    _add_tls_args(p)
    p.add_argument("--max-inflight", type=int, default=_R.max_inflight,
                   help="generations (choices) admitted at once; beyond it requests wait in the router's queue, "
                        "most urgent first (0: unbounded)")
    p.add_argument("--queue-size", type=int, default=_R.queue_size,
                   help="requests waiting past --max-inflight; beyond it 429 for the least urgent (0: no queue)")
    p.add_argument("--queue-timeout", type=float, default=_R.queue_timeout_s,
                   help="seconds a request may wait in the router's queue before 429")
    p.add_argument("--request-timeout", type=float, default=_R.request_timeout_s,
                   help="seconds before an unfinished request gets 504 and is aborted (0: none)")
    p.add_argument("--shutdown-grace", type=float, default=_R.shutdown_grace_s,
                   help="on Ctrl-C or SIGTERM, seconds requests in flight get to finish before they are aborted; "
                        "workers get as long again to stop (default: %(default)s)")
    p.add_argument("--stream-stall-timeout", type=float, default=_R.stream_stall_timeout_s,
                   help="a streaming client that reads nothing for this many seconds has its requests aborted; "
                        "until then its tokens wait in a bounded buffer (0: no limit; default: %(default)s)")
    p.add_argument("--max-body-size", default=f"{_R.max_body_bytes >> 20}MiB",
                   help="request bodies past this size get 413 before they are parsed (0: no limit; "
                        "default: %(default)s)")
    g = p.add_argument_group("priorities and tenants")
    g.add_argument("--sheddable-priority", type=int, default=_R.sheddable_priority,
                   help="requests of at least this `priority` are answered 429 while every decode worker is "
                        "saturated (default: %(default)s; lower priority values are served sooner)")
    g.add_argument("--tenant-max-inflight", type=int, default=_R.tenant_max_inflight,
                   help="requests one tenant (API key, or the x-pdserve-tenant header) may have in flight "
                        "(0: no limit)")
    g.add_argument("--tenant-max-queued-tokens", type=int, default=_R.tenant_max_queued_tokens,
                   help="prompt tokens one tenant may have waiting for their first token (0: no limit)")
    g.add_argument("--session-kv-limit", type=float, default=_R.session_kv_limit,
                   help="a session (x-pdserve-session header, or `user`) stays on its decode worker while that "
                        "worker's KV usage is below this (default: %(default)s)")
    _add_registry_args(p)
    _add_tracing_args(p)


def _add_tls_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("internal TLS (mutual TLS between router and workers; all three files, or none)")
    g.add_argument("--tls-cert", default=_env("PDSERVE_TLS_CERT"), help="certificate chain, PEM")
    g.add_argument("--tls-key", default=_env("PDSERVE_TLS_KEY"), help="its private key, PEM")
    g.add_argument("--tls-ca", default=_env("PDSERVE_TLS_CA"), help="the cluster CA, PEM")
    g.add_argument("--tls-server-name", default=_env("PDSERVE_TLS_SERVER_NAME"),
                   help="name to verify in the workers' certificates (default: the address dialled)")


def _add_tracing_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--otlp-traces-endpoint", default=_env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"), metavar="URL",
                   help="send OpenTelemetry traces of every request (router, prefill and decode spans, joined "
                        "across the hops) to this OTLP/HTTP collector, e.g. http://127.0.0.1:4318 (env "
                        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT; default: no tracing). Needs pdserve[tracing]")


def tracing_config(args: argparse.Namespace) -> TracingConfig:
    return TracingConfig(otlp_traces_endpoint=args.otlp_traces_endpoint)


def _add_registry_args(p: argparse.ArgumentParser, name_required: bool = False) -> None:
    p.add_argument("--redis-url", default=_env("PDSERVE_REDIS_URL"),
                   help="the cluster's Redis (env PDSERVE_REDIS_URL, which keeps a password out of `ps`); "
                        "`pdserve up` without one starts an embedded redis-server")
    p.add_argument("--cluster-name", required=name_required, default="",
                   help="the cluster's registry namespace" + ("" if name_required else " (default: random)"))


def _add_lora_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lora-modules", action="append", default=[], metavar="NAME=PATH",
                   help="a PEFT LoRA adapter every worker loads at start, selected by a request's `model: NAME` "
                        "(repeatable, as vLLM's flag; needs --max-loras)")
    p.add_argument("--max-loras", type=int, default=None,
                   help=f"LoRA adapters resident per worker, least recently used dropped first (default: "
                        f"{_L.max_loras}, LoRA off; with --lora-modules: at least their number)")
    p.add_argument("--max-lora-rank", type=int, default=_L.max_lora_rank,
                   help="the largest adapter rank accepted (default: %(default)s)")


def lora_config(args: argparse.Namespace) -> LoRAConfig:
    """The workers' LoRA adapters: --lora-modules name=path (repeatable), --max-loras (at least
    the modules' number when they are given without it), --max-lora-rank."""
    modules = []
    for item in args.lora_modules:
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"--lora-modules takes NAME=PATH, got {item!r}")
        modules.append((name.strip(), path.strip()))
    max_loras = args.max_loras if args.max_loras is not None else max(len(modules), _L.max_loras)
    return LoRAConfig(max_loras=max_loras, max_lora_rank=args.max_lora_rank, modules=tuple(modules))


def add_up_args(p: argparse.ArgumentParser) -> None:
    add_router_args(p)
    _add_lora_args(p)
    p.add_argument("--prefill", type=int, default=_P.replicas, help="prefill workers (default: %(default)s)")
    p.add_argument("--decode", type=int, default=_P.replicas, help="decode workers (default: %(default)s)")
    p.add_argument("--models-file", default="", metavar="FILE",
                   help="serve several base models, each with its own pools and adapters, routed by a request's "
                        "`model`: a TOML (or .json) file of [[model]] tables (docs/models.md); the pool and engine "
                        "flags are every model's defaults")
    p.add_argument("--mode", choices=MODES, default=MODES[0],
                   help="aggregated: --decode workers that prefill themselves, no prefill pool")
    for pool in ("prefill", "decode"):
        p.add_argument(f"--{pool}-cpus", type=float, default=None,
                       help=f"Ray CPUs per {pool} worker; its threads follow (default: {_P.num_cpus:g}, or with "
                            "--mode aggregated the machine's cores shared by the decode workers)")
        p.add_argument(f"--{pool}-gpus", type=float, default=_P.num_gpus,
                       help=f"GPUs per {pool} worker (with --device cuda)")
        p.add_argument(f"--{pool}-resource", default=_P.resource, help=f"custom Ray resource each {pool} worker "
                       "takes 1 of (e.g. the one a KubeRay worker group advertises): places the pool on those nodes")
        p.add_argument(f"--{pool}-kv-cache-dtype", choices=KV_CACHE_DTYPES, default=None,
                       help=f"KV cache dtype of the {pool} workers (default: --kv-cache-dtype); the KV is "
                            "converted on the hand-off when the pools differ")
        p.add_argument(f"--{pool}-tp", type=int, default=0,
                       help=f"tensor-parallel degree of each {pool} worker (default: --tp); pools may differ")
        p.add_argument(f"--{pool}-ep", type=int, default=0,
                       help=f"expert-parallel degree of each {pool} worker of a mixture-of-experts model: its "
                            "experts split over N ranks (processes), attention replicated on each; at most the "
                            f"experts per layer, not with --{pool}-tp (default: --ep); pools may differ")
        p.add_argument(f"--{pool}-pp", type=int, default=0, help=f"pipeline-parallel degree of each {pool} worker: "
                       f"its layers split into N stages (processes); with --{pool}-tp T each stage is T ranks "
                       f"(PP x TP: N*T processes), with --{pool}-ep E each stage's experts split over E ranks "
                       "(PP x EP: N*E processes); at most the layers (default: --pp)")
        p.add_argument(f"--{pool}-pp-layers", type=layer_counts, default=(), help=f"layers of each stage of a {pool} "
                       f"pipeline, stage 0 first, e.g. 12,18 (as many as --{pool}-pp, summing to the layers; "
                       "default: stage 0 fewer by the share of its LM head, sampling and scheduling)")
        p.add_argument(f"--{pool}-max-queue", type=int, default=_P.max_queue,
                       help=f"requests queued per {pool} worker before it refuses more (0: unbounded); a request "
                            "refused by every worker of a pool gets 429")
    p.add_argument("--ray-cpus", type=float, default=0.0,
                   help="CPUs of the local Ray cluster (room to scale the pools into with `pdserve scale`; "
                        "default: this machine's cores, or what the pools need if more)")
    p.add_argument("--no-share-cores", dest="share_cores", action="store_false",
                   help="CPU workers keep their own threads (by default workers on one host lend their cores to "
                        "each other while idle: a lone request's prefill and decode each run on every core)")
    p.add_argument("--worker-metrics-port", type=int, default=0,
                   help="port of each worker's own Prometheus /metrics (vLLM's model-server series, for a "
                        "Kubernetes endpoint picker); a worker whose host has it taken takes a free one "
                        "(default 0: any free port; -1: none)")
    p.add_argument("--max-restarts", type=int, default=_P.max_restarts,
                   help="Ray restarts a dead worker up to this many times; it re-registers (-1: always)")
    a = p.add_argument_group("autoscaling")
    a.add_argument("--autoscale", action="store_true",
                   help="size each pool from its own signals (prefill: queued tokens, TTFT; decode: KV usage, ITL)")
    a.add_argument("--autoscale-max", type=int, default=_A.max_replicas, help="most workers per pool when autoscaling")
    a.add_argument("--ttft-slo", type=float, default=_A.ttft_slo_s, help="TTFT p90 target of the autoscaler (s)")
    a.add_argument("--itl-slo", type=float, default=_A.itl_slo_s, help="ITL p90 target of the autoscaler (s)")
    a.add_argument("--autoscale-interval", type=float, default=_A.interval_s, help="seconds between rounds")
    a.add_argument("--autoscale-up-after", type=float, default=_A.up_after_s,
                   help="a pool overloaded this long (s, continuously) grows")
    a.add_argument("--autoscale-down-after", type=float, default=_A.down_after_s,
                   help="a pool underused this long (s, continuously) shrinks")
    a.add_argument("--autoscale-cooldown", type=float, default=_A.cooldown_s, help="seconds between two changes of a pool")
    p.add_argument("--no-router", action="store_true",
                   help="run the pools only (routers run elsewhere: `pdserve router`); --port then serves "
                        "/health and the admin endpoints")
    p.add_argument("--redis-password", default=_env("PDSERVE_REDIS_PASSWORD"),
                   help="password of the embedded Redis (without --redis-url; env PDSERVE_REDIS_PASSWORD; default: "
                        "random per cluster): a router added with `pdserve router` needs it in its --redis-url")
    p.add_argument("--ray-address", default="", help="join this Ray cluster instead of starting one")
    p.add_argument("--worker-host", default="", help="address workers serve on: 'auto' (their node's IP, the "
                   "default with --ray-address) or an address (default without: 127.0.0.1)")
    _add_transfer_args(p)
    p.add_argument("--local-prefill-threshold", type=int, default=_T.local_prefill_threshold,
                   help="prompts of at most this many tokens are prefilled on the decode worker")


def _add_transfer_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-transport", choices=KV_TRANSPORTS, default=_T.transport,
                   help="how decode workers receive KV: grpc, or ucx (pip install 'pdserve[ucx]'; RDMA/NVLink/"
                        "shared memory where present, TCP elsewhere)")
    p.add_argument("--kv-layer-group", type=int, default=_T.layer_group,
                   help="prefill workers push a prompt's KV every N layers as they are computed, overlapping "
                        "transfer with compute (0: all layers at the end)")
    p.add_argument("--kv-wire-dtype", choices=KV_WIRE_DTYPES, default=_T.wire_dtype,
                   help="what prefill workers send KV as: auto (as their cache holds it), or bf16/fp8/int8 "
                        "for the transfer only (fewer bytes on a slow link; the decode side converts)")
    p.add_argument("--kv-dtype-mismatch", choices=KV_DTYPE_MISMATCH, default=_T.kv_dtype_mismatch,
                   help="KV arriving in another format than the decode cache's: convert it, or refuse the push")
    p.add_argument("--transfer-policy", choices=TRANSFER_POLICIES, default=_T.policy,
                   help="when a KV hand-off fails: prefill on the decode worker, or fail the request")
    p.add_argument("--kv-peer-pull", choices=("auto", "always", "off"), default=_T.peer_pull,
                   help="a worker pulls a prompt's prefix blocks from a peer the router names (one holding more "
                        "of it, in its pool or a tier): auto (when faster than computing them, by measured "
                        "transfer and prefill rates), always, or off")
    p.add_argument("--kv-peer-timeout", type=float, default=_T.peer_timeout_s,
                   help="seconds a peer pull may take before the worker computes the prefix instead")
    p.add_argument("--prefill-timeout", type=float, default=_T.prefill_timeout_s,
                   help="seconds a decode worker waits for a prompt handed to a prefill worker (its queue there "
                        "included) before the transfer policy applies")


def add_router_cmd_args(p: argparse.ArgumentParser) -> None:
    """`pdserve router`: the router's flags, the registry it reads, and what it must know of
    the workers' engines (the tokenizer's model, the KV block size its prefix hashes use)."""
    add_router_args(p)
    p.add_argument("--model", default="", help="the cluster's model file or directory (for the tokenizer)")
    p.add_argument("--block-size", type=int, default=CacheConfig().block_size,
                   help="the workers' KV block size (prefix hashing)")
    p.add_argument("--models-file", default="", metavar="FILE",
                   help="the models file of a cluster serving several base models (`pdserve up --models-file`): "
                        "one router per model, each with its tokenizer and its workers")


def add_worker_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--role", choices=ROLES, required=True)
    _add_lora_args(p)
    p.add_argument("--metrics-port", type=int, default=_W.metrics_port,
                   help="port of this worker's own /metrics (vllm:* model-server series): 0 any free one, -1 none")
    p.add_argument("--worker-id", required=True, help="unique in the cluster, e.g. prefill-host3")
    p.add_argument("--host", default="127.0.0.1", help="bind and advertise address of its services")
    p.add_argument("--redis-url", default=_env("PDSERVE_REDIS_URL"), help="the cluster's registry (env PDSERVE_REDIS_URL)")
    p.add_argument("--cluster-name", required=True)
    p.add_argument("--cluster-token", default=_env("PDSERVE_CLUSTER_TOKEN"))
    _add_transfer_args(p)
    p.add_argument("--max-queue", type=int, default=_P.max_queue, help="requests queued here before it refuses more")
    p.add_argument("--drain-timeout", type=float, default=_W.drain_timeout_s,
                   help="on Ctrl-C/SIGTERM: seconds the requests in flight get to finish (then the router migrates them)")
    _add_tls_args(p)
    _add_tracing_args(p)


def add_scale_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the `pdserve up` whose pools to resize")
    p.add_argument("--api-key", default=_env("PDSERVE_API_KEY"), help="(env PDSERVE_API_KEY)")
    p.add_argument("--prefill", type=int, default=None, help="prefill workers wanted")
    p.add_argument("--decode", type=int, default=None, help="decode workers wanted")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait (removed workers drain first)")


# ---- flags -> config ------------------------------------------------------------------------
def security_config(args: argparse.Namespace) -> SecurityConfig:
    """The API keys, cluster token and internal TLS; the TLS files are read now (a missing
    one is a TLSConfigError at start, not on the first request)."""
    tls = TLSConfig(cert_file=args.tls_cert, key_file=args.tls_key, ca_file=args.tls_ca,
                    server_name=args.tls_server_name)
    if tls.enabled:
        tls.server_credentials()
    api_key = getattr(args, "api_key", "")  # a worker serves no API
    keys_file = getattr(args, "keys_file", "")
    return SecurityConfig(api_keys=(api_key,) if api_key else (), keys_file=keys_file,
                          cluster_token=args.cluster_token, tls=tls)


def transfer_config(args: argparse.Namespace) -> TransferConfig:
    """The KV hand-off's settings (`pdserve worker` has no --local-prefill-threshold: the default)."""
    return TransferConfig(transport=args.kv_transport, layer_group=args.kv_layer_group, policy=args.transfer_policy,
                          local_prefill_threshold=getattr(args, "local_prefill_threshold", _T.local_prefill_threshold),
                          wire_dtype=args.kv_wire_dtype, kv_dtype_mismatch=args.kv_dtype_mismatch,
                          peer_pull=args.kv_peer_pull, peer_timeout_s=args.kv_peer_timeout,
                          prefill_timeout_s=args.prefill_timeout)


def _router_config(args: argparse.Namespace) -> RouterConfig:
    return RouterConfig(host=args.host, port=args.port, model_name=args.served_model_name, routing=args.routing,
                        decode_local_prefill=args.decode_local_prefill,
                        prefill_queue_limit=args.prefill_queue_limit, hold_tokens=args.hold_tokens,
                        idle_decode_prefill=args.idle_decode_prefill, urgent_lend_window_s=args.urgent_lend_window,
                        max_inflight=args.max_inflight,
                        queue_size=args.queue_size, queue_timeout_s=args.queue_timeout,
                        special_tokens_in_content=args.special_tokens_in_content,
                        stream_stall_timeout_s=args.stream_stall_timeout, shutdown_grace_s=args.shutdown_grace,
                        request_timeout_s=args.request_timeout,
                        max_body_bytes=parse_size(args.max_body_size), sheddable_priority=args.sheddable_priority,
                        tenant_max_inflight=args.tenant_max_inflight,
                        tenant_max_queued_tokens=args.tenant_max_queued_tokens,
                        session_kv_limit=args.session_kv_limit)


def _pool(args: argparse.Namespace, role: str, replicas: int) -> PoolConfig:
    cpus = getattr(args, f"{role}_cpus", None)
    if cpus is None:  # an aggregated worker prefills and decodes: it gets the cores no prefill pool takes
        aggregated = getattr(args, "mode", "") == "aggregated" and role == "decode"
        cpus = max(1, (os.cpu_count() or 1) // max(replicas, 1)) if aggregated else _P.num_cpus
    return PoolConfig(replicas=replicas, num_cpus=cpus, num_gpus=getattr(args, f"{role}_gpus"),
                      max_queue=getattr(args, f"{role}_max_queue"), max_restarts=args.max_restarts,
                      resource=getattr(args, f"{role}_resource"),
                      kv_cache_dtype=getattr(args, f"{role}_kv_cache_dtype", None) or "",
                      tp=getattr(args, f"{role}_tp", 0) or 0, ep=getattr(args, f"{role}_ep", 0) or 0,
                      pp=getattr(args, f"{role}_pp", 0) or 0, pp_layers=getattr(args, f"{role}_pp_layers", ()))


def up_config(args: argparse.Namespace) -> ClusterConfig:
    """`pdserve up`'s cluster; a cluster without a name or a cluster token gets a random one
    (the launcher hands the token to its workers and routers; another router joining the
    cluster is given it: --cluster-token)."""
    security = security_config(args)
    if not security.cluster_token:
        security = replace(security, cluster_token=secrets.token_urlsafe(24))
    engine = replace(engine_config(args), lora=lora_config(args))
    prefill, decode = _pool(args, "prefill", args.prefill), _pool(args, "decode", args.decode)
    models = ()
    if getattr(args, "models_file", ""):
        from pdserve.models_file import load_models_file

        if args.served_model_name or args.lora_modules:
            raise ValueError("with --models-file, each model's name and --lora-modules go in the file "
                             "(name = ..., lora_modules = {...})")
        models = load_models_file(args.models_file, engine, prefill, decode)
    return ClusterConfig(
        mode=args.mode, engine=engine, router=_router_config(args), prefill=prefill, decode=decode, models=models,
        transfer=transfer_config(args),
        registry=RegistryConfig(redis_url=args.redis_url, cluster_name=args.cluster_name or uuid.uuid4().hex[:8]),
        security=security, tracing=tracing_config(args),
        autoscale=AutoscaleConfig(enabled=args.autoscale, max_replicas=args.autoscale_max, ttft_slo_s=args.ttft_slo,
                                  itl_slo_s=args.itl_slo, interval_s=args.autoscale_interval,
                                  up_after_s=args.autoscale_up_after, down_after_s=args.autoscale_down_after,
                                  cooldown_s=args.autoscale_cooldown),
        ray_address=args.ray_address, worker_host=args.worker_host, share_cores=args.share_cores,
        ray_cpus=args.ray_cpus, redis_password=args.redis_password, worker_metrics_port=args.worker_metrics_port)


def router_config(args: argparse.Namespace) -> ClusterConfig:
    """`pdserve router`'s view of a running cluster: its registry, and of its engines the
    model (for the tokenizer) and the KV block size."""
    if not args.redis_url:
        raise ValueError("pdserve router needs the cluster's registry: --redis-url (or PDSERVE_REDIS_URL)")
    if not args.cluster_name:
        raise ValueError("pdserve router needs the cluster's name: --cluster-name (see `pdserve up`'s log)")
    engine = EngineConfig(model=args.model, cache=CacheConfig(block_size=args.block_size))
    models = ()
    if args.models_file:
        from pdserve.models_file import load_models_file

        models = load_models_file(args.models_file, engine, PoolConfig(), PoolConfig())
    return ClusterConfig(engine=engine, router=_router_config(args), security=security_config(args), models=models,
                         tracing=tracing_config(args),
                         registry=RegistryConfig(redis_url=args.redis_url, cluster_name=args.cluster_name))


def worker_config(args: argparse.Namespace) -> WorkerConfig:
    """`pdserve worker`: one worker joining a cluster's registry."""
    if not args.redis_url:
        raise ValueError("pdserve worker needs the cluster's registry: --redis-url (or PDSERVE_REDIS_URL)")
    return WorkerConfig(role=args.role, worker_id=args.worker_id, host=args.host, max_queue=args.max_queue,
                        engine=replace(engine_config(args), lora=lora_config(args)),
                        transfer=transfer_config(args), drain_timeout_s=args.drain_timeout,
                        metrics_port=args.metrics_port,
                        registry=RegistryConfig(redis_url=args.redis_url, cluster_name=args.cluster_name),
                        security=security_config(args), tracing=tracing_config(args))
