"""The in-process clusters the tests start: a `ClusterConfig` with the tests' defaults, and
the TLS identities of clusters that use mutual TLS."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from pdserve.config import ClusterConfig, PoolConfig, RegistryConfig, RouterConfig
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.protos.security import TLSConfig

MODEL = "smollm2"  # the API name the tests ask for
TLS_NAME = "pdserve-cluster"  # the certificate names the cluster, not an address: pods get arbitrary IPs


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


def write_identity(ca, directory: Path, tag: str) -> TLSConfig:
    """A certificate for the cluster's name from `ca` (a trustme.CA), its key and the CA, as
    PEM files `tag-*.pem` in `directory`."""
    cert = ca.issue_cert(TLS_NAME)
    paths = {k: directory / f"{tag}-{k}.pem" for k in ("cert", "key", "ca")}
    paths["cert"].write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
    cert.private_key_pem.write_to_path(str(paths["key"]))
    ca.cert_pem.write_to_path(str(paths["ca"]))
    return TLSConfig(str(paths["cert"]), str(paths["key"]), str(paths["ca"]), server_name=TLS_NAME)
