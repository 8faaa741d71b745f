"""The cluster's typed configuration: one tree, built once from the command line (or by a
caller) and passed down whole or by branch. Nothing below the CLI reads flags or the
environment.

    ClusterConfig
    ├── engine: EngineConfig        (pdserve.engine.config: model, KV cache, scheduler)
    ├── router: RouterConfig        the OpenAI front end and its routing
    ├── prefill, decode: PoolConfig each pool's size and resources
    ├── transfer: TransferConfig    the KV hand-off between the pools
    ├── registry: RegistryConfig    Redis: membership and KV events
    ├── security: SecurityConfig    API keys, the cluster token, internal TLS
    ├── tracing: TracingConfig      OpenTelemetry traces of every process
    ├── autoscale: AutoscaleConfig  pool sizes from their own signals
    └── models: ServedModel, ...    several base models, each with its own engine and pools
                                    (none: the one model of `engine`, `prefill`, `decode`)

A worker gets a `WorkerConfig`: its identity plus the branches that concern it.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from pdserve.engine.config import KV_CACHE_DTYPES, EngineConfig
from pdserve.common.checks import at_least, one_of
from pdserve.kv_transfer.config import (  # noqa: F401 - the tree's branches, defined beside their users
    KV_DTYPE_MISMATCH, KV_TRANSPORTS, KV_WIRE_DTYPES, TRANSFER_POLICIES, TransferConfig)
from pdserve.protos.security import SecurityConfig, TLSConfig  # noqa: F401

ROUTING_POLICIES = ("prefix_aware", "round_robin", "least_loaded")
MODES = ("disaggregated", "aggregated")
ROLES = ("prefill", "decode", "aggregated")
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class TracingConfig:
    otlp_traces_endpoint: str = ""
    """The OTLP/HTTP collector every process sends its spans to (`http://host:4318`, or the
    full `.../v1/traces` URL); "": no tracing, at no cost (pdserve.protos.tracing)."""


@dataclass(frozen=True)
class RegistryConfig:
    redis_url: str = field(default="", repr=False)
    """The cluster's Redis ("": no registry: workers are wired statically, no KV events)."""
    cluster_name: str = "default"
    """Namespace of this cluster's keys and streams in Redis."""


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    """0: any free port."""
    model_name: str = ""
    """The model id clients must name ("": the model file's name)."""
    routing: str = "prefix_aware"
    """How a pool's worker is chosen: prefix_aware | round_robin | least_loaded."""
    decode_local_prefill: int = 64
    """A decode worker whose own cache holds all of a prompt but at most this many tokens
    prefills the rest itself (no prefill worker, no KV transfer); 0: never."""
    prefill_queue_limit: int = 512
    """Conditional disaggregation by load: once the chosen prefill worker has this many prompt
    tokens queued, a prompt that would wait less on its decode worker is prefilled there
    (router/policies.prefill_on_decode); 0: always the prefill pool."""
    hold_tokens: int = 2048
    """Late binding: while every prefill worker has this many prompt tokens queued and no decode
    worker would take the prompt, the router holds it and routes it when a place opens, so a
    burst does not split between the pools by the loads at its arrival (router/holding.py);
    0: every prompt routed at once. Only with prefill_queue_limit > 0."""
    idle_decode_prefill: bool = True
    """A decode worker with no stream and no prompt of its own prefills a prompt itself: no
    stream's ITL pays for it, and the prompt skips the KV hand-off (on one host: 859 -> 696 ms
    TTFT p50 for 240-token prompts, one at a time). Off: only by the two rules above."""
    urgent_lend_window_s: float = 5.0
    """No less urgent prompt is lent to a decode worker that streamed for a more urgent request
    within this many seconds (0: only while it streams for one; the worker's window steps,
    SchedulerConfig.window_step_s, then bound what a lent prompt adds to each step)."""
    special_tokens_in_content: bool = False
    """Encode control-token text inside chat message content as control tokens (as
    transformers and vLLM do); off: as plain text, so users cannot forge turns."""
    refresh_interval_s: float = 0.25
    """How often worker loads (and, with a registry, membership and KV events) are read."""
    max_inflight: int = 256
    """Generations (choices) admitted at once; beyond it a request waits in the router's queue
    (router/admission.py: most urgent first, tenants in turn). 0: unbounded."""
    queue_size: int = 1024
    """Requests waiting past max_inflight; when full, a request less urgent than every waiting
    one gets 429 with Retry-After (a more urgent one takes the least urgent's place). 0: no
    queue, 429 at once."""
    queue_timeout_s: float = 60.0
    """A request waiting this long in the router's queue gets 429 with Retry-After."""
    request_timeout_s: float = 600.0
    """A request not finished after this long gets 504 (and is aborted). 0: no limit."""
    shutdown_grace_s: float = 10.0
    """On Ctrl-C or SIGTERM, requests in flight get this long to finish; then they are
    aborted, and the workers get as long again to stop before they are killed."""
    stream_stall_timeout_s: float = 60.0
    """A streaming client that reads nothing for this long has its requests aborted (its
    deltas wait in a bounded buffer until then). 0: no limit."""
    max_body_bytes: int = 32 << 20
    """A request body past this size gets 413 before it is parsed. 0: no limit."""
    sheddable_priority: int = 10
    """Requests of at least this priority value are sheddable: answered 429 at once while every
    decode worker is saturated (KV nearly full or requests waiting) instead of queueing."""
    tenant_max_inflight: int = 0
    """Requests one tenant may have in flight; past it 429 for that tenant only. 0: no limit."""
    tenant_max_queued_tokens: int = 0
    """Prompt tokens one tenant may have waiting for their first token (a request alone may
    exceed it); past it 429 for that tenant only. 0: no limit."""
    session_kv_limit: float = 0.9
    """A session (x-pdserve-session header, or `user`) stays on its decode worker while that
    worker's KV usage is below this; then it moves (sticky until saturated)."""

    def __post_init__(self):
        one_of("routing", self.routing, ROUTING_POLICIES)
        for name in ("max_inflight", "request_timeout_s", "decode_local_prefill", "prefill_queue_limit",
                     "max_body_bytes", "stream_stall_timeout_s", "shutdown_grace_s", "tenant_max_inflight",
                     "tenant_max_queued_tokens", "session_kv_limit", "queue_size", "queue_timeout_s",
                     "urgent_lend_window_s", "hold_tokens"):
            at_least(name, getattr(self, name), 0)
        at_least("refresh_interval_s", self.refresh_interval_s, 0.01)


def layer_counts(text: str) -> tuple[int, ...]:
    """Counts separated by commas ("12,18", a `--decode-pp-layers` flag's), as a tuple."""
    return tuple(int(x) for x in text.split(","))


@dataclass(frozen=True)
class PoolConfig:
    replicas: int = 1
    num_cpus: float = 1.0
    """Ray CPUs per worker; its torch threads follow."""
    num_gpus: float = 0.0
    max_queue: int = 256
    """Requests queued per worker before it refuses more (0: unbounded)."""
    max_restarts: int = 10
    """Ray restarts a dead worker process up to this many times (-1: always)."""
    resource: str = ""
    """A custom Ray resource each worker takes 1 of (e.g. a KubeRay worker group's)."""
    kv_cache_dtype: str = ""
    """The pool's KV cache dtype (engine/config.KV_CACHE_DTYPES); "": the cluster engine's.
    Pools may differ: the decode side converts the KV it receives."""
    tp: int = 0
    """Tensor-parallel degree of each worker of the pool; 0: the cluster engine's. Pools may
    differ: the KV crosses in the whole model's layout and each group splits it its way."""
    ep: int = 0
    """Expert-parallel degree of each worker of the pool (a mixture-of-experts model's experts
    split over its ranks, attention replicated: engine/parallel/ep.py); 0: the cluster
    engine's. Not with tp above 1."""
    pp: int = 0
    """Pipeline-parallel degree of each worker of the pool (its layers split into stages, one
    process each, or tp each with tp above 1, PP x TP, or ep each with ep above 1, PP x EP:
    engine/parallel/pp.py); 0: the cluster engine's."""
    pp_layers: tuple[int, ...] = ()
    """Layers of each stage of the pool's pipelines, stage 0 first (EngineConfig.pipeline_layers:
    as many as stages, each >= 1, summing to the model's layers); (): stage 0 fewer by its LM
    head's work (engine/parallel/pp.split_layers)."""

    def __post_init__(self):
        at_least("tp", self.tp, 0)
        at_least("ep", self.ep, 0)
        at_least("pp", self.pp, 0)
        object.__setattr__(self, "pp_layers", tuple(self.pp_layers))  # a list from a config file
        for n in self.pp_layers:
            at_least("each of pp_layers", n, 1)
        if self.pp_layers and self.pp and len(self.pp_layers) != self.pp:
            raise ValueError(f"a pool's pp_layers {','.join(map(str, self.pp_layers))} gives {len(self.pp_layers)} "
                             f"stages but its pp is {self.pp}: give one layer count a stage")
        if self.tp > 1 and self.ep > 1:
            raise ValueError(f"a pool's tp ({self.tp}) and ep ({self.ep}) cannot both be above 1: tensor parallelism "
                             "within an expert-parallel group is not implemented; use one of them")
        if self.kv_cache_dtype:
            one_of("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        at_least("replicas", self.replicas, 0)
        at_least("max_queue", self.max_queue, 0)
        at_least("max_restarts", self.max_restarts, -1)

    def ranks(self, engine) -> int:
        """Processes of each worker of this pool (its tensor-, expert- or pipeline-parallel
        degree, the pool's or else `engine`'s EngineConfig's)."""
        return ((self.tp or engine.tensor_parallel_size) * (self.ep or engine.expert_parallel_size)
                * (self.pp or engine.pipeline_parallel_size))


@dataclass(frozen=True)
class AutoscaleConfig:
    enabled: bool = False
    max_replicas: int = 4
    ttft_slo_s: float = 2.0
    """TTFT p90 target of the prefill pool."""
    itl_slo_s: float = 0.1
    """ITL p90 target of the decode pool."""
    interval_s: float = 5.0
    up_after_s: float = 30.0
    """A pool overloaded this long (continuously) grows."""
    down_after_s: float = 300.0
    """A pool underused this long (continuously) shrinks."""
    cooldown_s: float = 60.0
    """Seconds between two changes of a pool."""


@dataclass(frozen=True)
class WorkerConfig:
    """One worker: who it is, where it serves, and the cluster's settings it takes part in."""

    role: str
    """prefill | decode | aggregated (a decode worker that always prefills itself)."""
    worker_id: str
    host: str = "127.0.0.1"
    """Bind and advertised address of its services ("auto": its Ray node's address)."""
    max_queue: int = 0
    """Requests queued here before it refuses more (0: unbounded)."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    registry: RegistryConfig = field(default_factory=RegistryConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    drain_timeout_s: float = 30.0
    """On Ctrl-C or SIGTERM (`pdserve worker`): how long requests in flight get to finish
    before it stops (the router then migrates the streams left)."""
    metrics_port: int = 0
    """Port of the worker's own Prometheus /metrics (the model-server series a Kubernetes
    endpoint picker scores pods by: deploy/model_server_metrics.py), on its host: 0 any free
    port (advertised in the registry and on /admin/workers), -1 none."""
    core_share_dir: str = ""
    """Workers given the same directory on one host lend each other their cores while idle
    (engine/parallel/cores.py); "": this worker keeps its own threads."""

    def __post_init__(self):
        one_of("role", self.role, ROLES)
        at_least("drain_timeout_s", self.drain_timeout_s, 0)
        if self.host not in LOOPBACK_HOSTS and not self.security.cluster_token:
            raise ValueError(f"a worker serving on {self.host} is reachable from the network: set a cluster "
                             "token (--cluster-token or PDSERVE_CLUSTER_TOKEN, the same for the whole cluster) "
                             "so that only its routers and workers can call it")


@dataclass(frozen=True)
class ServedModel:
    """One base model of a cluster that serves several: its name in the API, its engine (the
    model file, its LoRA adapters, KV cache) and its own prefill and decode pools."""

    name: str
    engine: EngineConfig = field(default_factory=EngineConfig)
    prefill: PoolConfig = field(default_factory=PoolConfig)
    decode: PoolConfig = field(default_factory=PoolConfig)

    def __post_init__(self):
        if not self.name or not self.name.strip() or "/" in self.name or self.name != self.name.strip():
            raise ValueError(f"a served model's name must be non-empty, without '/' or surrounding spaces: "
                             f"got {self.name!r}")


@dataclass(frozen=True)
class ClusterConfig:
    mode: str = "disaggregated"
    """aggregated: decode workers that prefill themselves, no prefill pool (the baseline)."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    prefill: PoolConfig = field(default_factory=PoolConfig)
    decode: PoolConfig = field(default_factory=PoolConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    registry: RegistryConfig = field(default_factory=RegistryConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    autoscale: AutoscaleConfig = field(default_factory=AutoscaleConfig)
    ray_address: str = ""
    """Join this Ray cluster instead of starting one."""
    worker_host: str = ""
    """Address workers serve on: "auto" (their node's IP), an address, or "" (auto with
    ray_address, else 127.0.0.1)."""
    ray_cpus: float = 0.0
    """CPUs of the local Ray cluster `pdserve up` starts (room to grow the pools into);
    0: this machine's cores, or what the pools need if more."""
    redis_password: str = field(default="", repr=False)
    """Password of the embedded Redis `pdserve up` starts when the registry has no URL; "":
    random per cluster (workers get it in their Redis URL, like the cluster token)."""
    share_cores: bool = True
    """CPU workers on one host lend their cores to each other while idle (engine/parallel/cores.py): a
    lone request's prefill and decode each run on every core."""
    worker_metrics_port: int = 0
    """Port each worker serves its own Prometheus /metrics on (the model-server series a Kubernetes
    endpoint picker scrapes pods at: deploy/model_server_metrics.py): 0 any free port, -1 none. A
    worker whose host has the port taken already (several workers on one host) takes a free one;
    each worker's port is in its registry record and on /admin/workers."""
    models: tuple[ServedModel, ...] = ()
    """Several base models, each with its own engine and pools, routed by a request's `model`;
    empty: the one model of `engine`, `prefill` and `decode` (`router.model_name` names it)."""

    def __post_init__(self):
        one_of("mode", self.mode, MODES)
        at_least("worker_metrics_port", self.worker_metrics_port, -1)
        names = [m.name for m in self.models]
        adapters = [a for m in self.models for a, _ in m.engine.lora.modules]
        for name in set(names + adapters):
            if (names + adapters).count(name) > 1:
                raise ValueError(f"the served model or adapter name {name!r} is given more than once: each "
                                 "request's `model` must name one model")

    def model_clusters(self) -> list["ClusterConfig"]:
        """One cluster config per served model: its engine and pools in place of the top-level
        ones, its name as the router's model name, and its own registry namespace
        (cluster_name/model), where its workers register apart from the other models'. Without
        `models`: this config alone."""
        if not self.models:
            return [self]
        return [replace(self, engine=m.engine, prefill=m.prefill, decode=m.decode, models=(),
                        router=replace(self.router, model_name=m.name),
                        registry=replace(self.registry, cluster_name=f"{self.registry.cluster_name}/{m.name}"))
                for m in self.models]

    def pools(self) -> dict[str, PoolConfig]:
        """The pools this cluster runs, by role."""
        if self.mode == "aggregated":
            return {"aggregated": self.decode}
        return {"prefill": self.prefill, "decode": self.decode}

    def worker(self, role: str, worker_id: str, **overrides) -> WorkerConfig:
        """The config of one worker of the pool `role`."""
        pool = self.pools()[role]
        engine = self.engine
        if pool.kv_cache_dtype:
            engine = replace(engine, cache=replace(engine.cache, kv_cache_dtype=pool.kv_cache_dtype))
        if pool.tp or pool.ep or pool.pp or pool.pp_layers:
            engine = replace(engine, tensor_parallel_size=pool.tp or engine.tensor_parallel_size,
                             expert_parallel_size=pool.ep or engine.expert_parallel_size,
                             pipeline_parallel_size=pool.pp or engine.pipeline_parallel_size,
                             pipeline_layers=pool.pp_layers or engine.pipeline_layers)
        if role == "prefill":  # a prefill worker samples one token per prompt: nothing to speculate
            engine = replace(engine, speculative_tokens=0, speculative_model="", speculative_quantization="")
        fields = dict(host=self.worker_host or ("auto" if self.ray_address else "127.0.0.1"),
                      max_queue=pool.max_queue, engine=engine, transfer=self.transfer,
                      registry=self.registry, security=self.security, tracing=self.tracing,
                      metrics_port=self.worker_metrics_port)
        return WorkerConfig(role=role, worker_id=worker_id, **(fields | overrides))
