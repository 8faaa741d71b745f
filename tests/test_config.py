"""The cluster's config tree and the flags that build it: a flag's default is its field's
default, every flag reaches its field, each worker gets its pool's branch, and a bad value
is refused naming the field."""
from __future__ import annotations

from dataclasses import fields, replace

import pytest

from pdserve import flags
from pdserve.cli import parser
from pdserve.config import (
    AutoscaleConfig,
    ClusterConfig,
    PoolConfig,
    RegistryConfig,
    RouterConfig,
    SecurityConfig,
    TransferConfig,
    WorkerConfig,
)
from pdserve.engine.config import CacheConfig, EngineConfig


def parse(*argv: str):
    return parser().parse_args(list(argv))


def test_up_without_flags_is_the_config_defaults(monkeypatch):
    for name in ("PDSERVE_API_KEY", "PDSERVE_CLUSTER_TOKEN", "PDSERVE_REDIS_URL", "PDSERVE_TLS_CERT"):
        monkeypatch.delenv(name, raising=False)
    got = flags.up_config(parse("up"))
    assert len(got.registry.cluster_name) == 8  # a random name, printed at start
    assert len(got.security.cluster_token) >= 32  # a random token too: workers are not open by default
    want = ClusterConfig(registry=RegistryConfig(cluster_name=got.registry.cluster_name),
                         security=replace(SecurityConfig(), cluster_token=got.security.cluster_token))
    assert {f.name: getattr(got, f.name) for f in fields(got)} == {f.name: getattr(want, f.name) for f in fields(want)}
    assert flags.up_config(parse("up")).registry.cluster_name != got.registry.cluster_name
    assert got.share_cores and got.router.prefill_queue_limit == 512


def test_an_aggregated_cluster_takes_every_core_unless_told(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert flags.up_config(parse("up", "--mode", "aggregated")).decode.num_cpus == 8
    assert flags.up_config(parse("up", "--mode", "aggregated", "--decode", "3")).decode.num_cpus == 2
    assert flags.up_config(parse("up", "--mode", "aggregated", "--decode-cpus", "1")).decode.num_cpus == 1
    disagg = flags.up_config(parse("up", "--no-share-cores", "--prefill-queue-limit", "0", "--hold-tokens", "0"))
    assert (disagg.prefill.num_cpus, disagg.decode.num_cpus, disagg.share_cores) == (1, 1, False)
    assert disagg.router.prefill_queue_limit == 0 and disagg.router.hold_tokens == 0
    assert flags.up_config(parse("up")).router.hold_tokens == 2048


def test_every_up_flag_reaches_its_field(monkeypatch):
    monkeypatch.setenv("PDSERVE_CLUSTER_TOKEN", "from-env")
    c = flags.up_config(parse(
        "up", "--prefill", "2", "--decode", "3", "--prefill-cpus", "0.5", "--decode-gpus", "1", "--decode-max-queue", "5",
        "--prefill-resource", "pf", "--max-restarts", "-1", "--routing", "round_robin", "--decode-local-prefill", "0",
        "--max-inflight", "9", "--request-timeout", "30", "--max-body-size", "1MiB", "--served-model-name", "m", "--host", "0.0.0.0",
        "--port", "9000", "--api-key", "k", "--kv-transport", "ucx", "--kv-layer-group", "5",
        "--transfer-policy", "fail", "--local-prefill-threshold", "12", "--redis-url", "redis://h:1/0",
        "--cluster-name", "prod", "--autoscale", "--autoscale-max", "6", "--ttft-slo", "3", "--itl-slo", "0.2",
        "--autoscale-interval", "2", "--autoscale-up-after", "10", "--autoscale-down-after", "20",
        "--autoscale-cooldown", "7", "--ray-address", "ray://head:10001", "--worker-host", "auto",
        "--threads", "2", "--block-size", "32", "--kv-cache-memory", "256MiB", "--quantization", "int8",
        "--decode-kv-cache-dtype", "bf16", "--worker-metrics-port", "9400", "--prefill-timeout", "90"))
    assert c.prefill == PoolConfig(replicas=2, num_cpus=0.5, max_queue=256, max_restarts=-1, resource="pf")
    assert c.decode == PoolConfig(replicas=3, num_gpus=1.0, max_queue=5, max_restarts=-1, kv_cache_dtype="bf16")
    assert c.worker("decode", "d").engine.cache.kv_cache_dtype == "bf16"
    assert c.worker("prefill", "p").engine.cache.kv_cache_dtype == "auto"  # the cluster's --kv-cache-dtype
    assert c.router == RouterConfig(host="0.0.0.0", port=9000, model_name="m", routing="round_robin",
                                    decode_local_prefill=0, max_inflight=9, request_timeout_s=30.0,
                                    max_body_bytes=1 << 20)
    assert c.transfer == TransferConfig(transport="ucx", layer_group=5, policy="fail", local_prefill_threshold=12,
                                        prefill_timeout_s=90.0)
    assert c.worker("decode", "d").transfer.prefill_timeout_s == 90.0
    assert c.registry == RegistryConfig(redis_url="redis://h:1/0", cluster_name="prod")
    assert (c.security.api_keys, c.security.cluster_token) == (("k",), "from-env")
    assert c.autoscale == AutoscaleConfig(enabled=True, max_replicas=6, ttft_slo_s=3.0, itl_slo_s=0.2, interval_s=2.0,
                                          up_after_s=10.0, down_after_s=20.0, cooldown_s=7.0)
    assert (c.ray_address, c.worker_host) == ("ray://head:10001", "auto")
    assert c.worker_metrics_port == 9400 and c.worker("decode", "d").metrics_port == 9400
    assert c.engine == EngineConfig(num_threads=2, quantization="int8",
                                    cache=CacheConfig(block_size=32, kv_cache_memory=256 << 20))


def test_each_worker_gets_its_pools_branch():
    c = ClusterConfig(decode=PoolConfig(max_queue=3), prefill=PoolConfig(max_queue=7),
                      transfer=TransferConfig(policy="fail"), registry=RegistryConfig(cluster_name="x"))
    w = c.worker("decode", "decode-4")
    assert (w.role, w.worker_id, w.host, w.max_queue) == ("decode", "decode-4", "127.0.0.1", 3)
    assert (w.transfer, w.registry, w.engine, w.security) == (c.transfer, c.registry, c.engine, c.security)
    assert c.worker("prefill", "p").max_queue == 7
    multi_node = replace(c, ray_address="ray://h:1", security=SecurityConfig(cluster_token="t"))
    assert multi_node.worker("prefill", "p").host == "auto"  # its node's address
    with pytest.raises(ValueError, match="reachable from the network: set a cluster token"):
        replace(c, ray_address="ray://h:1").worker("prefill", "p")  # open to the network: refused
    assert list(c.pools()) == ["prefill", "decode"]
    assert replace(c, mode="aggregated").pools() == {"aggregated": c.decode}


def test_a_ray_pools_workers_keep_their_pools_engine_settings():
    """What `pdserve up` gives each worker actor: the pool's KV dtype and degree (they were once
    dropped when the threads were set), no speculation on prefill, and threads that follow the
    CPUs, for every rank of a tensor-parallel worker."""
    from pdserve.deploy.launch import Pool

    c = ClusterConfig(engine=EngineConfig(speculative_tokens=4),
                      prefill=PoolConfig(num_cpus=2, kv_cache_dtype="int8", tp=3),
                      decode=PoolConfig(num_cpus=1.5, kv_cache_dtype="fp8"))
    prefill, decode = (Pool(role, c).worker_config(f"{role}-0").engine for role in ("prefill", "decode"))
    assert (prefill.cache.kv_cache_dtype, prefill.tensor_parallel_size, prefill.num_threads) == ("int8", 3, 6)
    assert (decode.cache.kv_cache_dtype, decode.tensor_parallel_size, decode.num_threads) == ("fp8", 1, 1)
    assert (prefill.speculative_tokens, decode.speculative_tokens) == (0, 4)
    assert Pool("decode", c).worker_config("decode-0").core_share_dir  # one rank: lends its cores
    assert not Pool("prefill", c).worker_config("prefill-0").core_share_dir


def test_router_and_worker_commands_build_their_configs():
    r = flags.router_config(parse("router", "--redis-url", "redis://h:1/0", "--cluster-name", "prod",
                                  "--block-size", "32", "--model", "/m.gguf"))
    assert (r.registry.cluster_name, r.engine.model, r.engine.cache.block_size) == ("prod", "/m.gguf", 32)
    with pytest.raises(ValueError, match="--cluster-name"):
        flags.router_config(parse("router", "--redis-url", "redis://h:1/0"))
    w = flags.worker_config(parse("worker", "--role", "prefill", "--worker-id", "p9", "--cluster-name", "prod",
                                  "--redis-url", "redis://h:1/0", "--max-queue", "2", "--kv-layer-group", "5"))
    assert w == WorkerConfig(role="prefill", worker_id="p9", max_queue=2, transfer=TransferConfig(layer_group=5),
                             registry=RegistryConfig(redis_url="redis://h:1/0", cluster_name="prod"),
                             security=w.security)
    with pytest.raises(ValueError, match="--redis-url"):
        flags.worker_config(parse("worker", "--role", "decode", "--worker-id", "d", "--cluster-name", "c",
                                  "--redis-url", ""))


def test_worker_command_takes_tls_and_drain_timeout_into_its_config(tmp_path):
    """`pdserve worker` joins a cluster whose internal calls are mutual TLS: it needs the same
    TLS flags as `pdserve up` and `pdserve router`, and its drain timeout is part of its config."""
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    files = {name: tmp_path / f"{name}.pem" for name in ("cert", "key", "ca")}
    cert.cert_chain_pems[0].write_to_path(files["cert"])
    cert.private_key_pem.write_to_path(files["key"])
    ca.cert_pem.write_to_path(files["ca"])
    w = flags.worker_config(parse("worker", "--role", "decode", "--worker-id", "d1", "--cluster-name", "c",
                                  "--redis-url", "redis://h:1/0", "--tls-cert", str(files["cert"]),
                                  "--tls-key", str(files["key"]), "--tls-ca", str(files["ca"]),
                                  "--drain-timeout", "7", "--cluster-token", "t0k"))
    assert w.security.tls.enabled and w.security.tls.cert_file == str(files["cert"])
    assert (w.drain_timeout_s, w.security.cluster_token, w.security.api_keys) == (7.0, "t0k", ())
    with pytest.raises(ValueError, match="drain_timeout_s"):
        replace(w, drain_timeout_s=-1)


@pytest.mark.parametrize("build,message", [
    (lambda: RouterConfig(routing="random"), "routing must be one of"),
    (lambda: RouterConfig(max_inflight=-1), "max_inflight must be >= 0"),
    (lambda: RouterConfig(refresh_interval_s=float("nan")), "refresh_interval_s"),
    (lambda: TransferConfig(transport="tcp"), "kv transport must be one of"),
    (lambda: TransferConfig(prefill_timeout_s=0), "prefill timeout must be"),
    (lambda: TransferConfig(policy="retry"), "transfer policy must be one of"),
    (lambda: PoolConfig(replicas=-1), "replicas must be >= 0"),
    (lambda: PoolConfig(max_restarts=-2), "max_restarts must be >= -1"),
    (lambda: PoolConfig(kv_cache_dtype="fp4"), "kv_cache_dtype must be one of"),
    (lambda: TransferConfig(wire_dtype="fp32"), "kv wire dtype must be one of"),
    (lambda: ClusterConfig(mode="split"), "mode must be one of"),
    (lambda: ClusterConfig(worker_metrics_port=-2), "worker_metrics_port must be >= -1"),
    (lambda: WorkerConfig(role="router", worker_id="w"), "role must be one of"),
])
def test_bad_values_are_refused_by_name(build, message):
    with pytest.raises(ValueError, match=message):
        build()
