"""The in-process clusters the tests start: a `ClusterConfig` with the tests' defaults."""
from __future__ import annotations

from dataclasses import replace

from pdserve.config import ClusterConfig, PoolConfig, RegistryConfig, RouterConfig
from pdserve.engine.config import CacheConfig, EngineConfig

MODEL = "smollm2"  # the API name the tests ask for


def local_config(kv_cache_memory: int = 64 << 20, *, prefill: int = 1, decode: int = 1, prefill_max_queue: int = 0,
                 decode_max_queue: int = 0, router: dict | None = None, **fields) -> ClusterConfig:
    """The default model under its API name, the router on any free port with no admission
    limit or timeout, every prompt through the prefill pool (no local prefill on the decode
    worker) and unbounded queues, unless given. `router`: RouterConfig fields; the other
    keywords are ClusterConfig's own."""
    rc = replace(RouterConfig(port=0, model_name=MODEL, decode_local_prefill=0, prefill_queue_limit=0,
                              idle_decode_prefill=False, max_inflight=0, request_timeout_s=0),
                 **(router or {}))
    fields.setdefault("engine", EngineConfig(cache=CacheConfig(kv_cache_memory=kv_cache_memory)))
    fields.setdefault("registry", RegistryConfig(cluster_name="local"))
    return ClusterConfig(router=rc, prefill=PoolConfig(replicas=prefill, max_queue=prefill_max_queue),
                         decode=PoolConfig(replicas=decode, max_queue=decode_max_queue), **fields)
