"""Mutual TLS on the internal gRPC services: a cluster with TLS serves (the KV hand-off goes
over TLS too), and callers without a certificate from the cluster CA, or speaking
plaintext, are refused at the handshake."""
import asyncio

import grpc
import httpx
import pytest

from pdserve.config import SecurityConfig
from pdserve.deploy.local import LocalCluster
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.core.engine import LLMEngine
from pdserve.common.sampling_params import SamplingParams
from pdserve.protos import worker_pb2 as pb
from pdserve.protos import worker_pb2_grpc as pb_grpc
from pdserve.protos.security import TLSConfig, TLSConfigError, open_channel, stats_request
from tests.helpers.clusters import local_config, write_identity

trustme = pytest.importorskip("trustme")
pytestmark = pytest.mark.slow
MODEL = "smollm2"


@pytest.fixture(scope="module")
def tls_cluster(smollm, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tls")
    tls = write_identity(trustme.CA(), tmp, "cluster")
    loaded, tok = smollm
    c = LocalCluster(loaded, tok, local_config(32 << 20, security=SecurityConfig(tls=tls, cluster_token="t0k")))
    c.start()
    c.tls, c.tmp = tls, tmp
    yield c
    c.stop()
    assert all(e.blocks.num_used_blocks == 0 and not e.has_unfinished_requests() for e in c.engines())


def stats(address: str, tls: TLSConfig | None, options=()) -> pb.WorkerStats:
    async def call():
        ch = open_channel(address, tls, options) if tls is not None else grpc.aio.insecure_channel(address)
        try:
            return await pb_grpc.DecodeServiceStub(ch).Stats(stats_request("t0k"), timeout=5)
        finally:
            await ch.close()
    return asyncio.run(call())


def test_cluster_serves_over_mutual_tls(tls_cluster, smollm):
    loaded, tok = smollm
    prompt = "The capital of France is"
    r = httpx.post(tls_cluster.url + "/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    ref = LLMEngine(loaded, EngineConfig(cache=CacheConfig(kv_cache_memory=16 << 20)), tok).generate(
        [tok.encode(prompt)], SamplingParams(max_tokens=8, temperature=0))[0]
    assert r.json()["choices"][0]["text"] == tok.decode(ref, skip_special_tokens=True)
    decode = tls_cluster.worker("decode-0").worker
    assert decode.remote_prefills >= 1 and decode.transfer_failures == 0  # the KV push went over TLS
    assert stats(decode.address, tls_cluster.tls).worker_id == "decode-0"


def test_plaintext_and_foreign_certificates_are_refused(tls_cluster):
    address = tls_cluster.worker("decode-0").worker.address
    with pytest.raises(grpc.aio.AioRpcError) as e:
        stats(address, None)  # plaintext
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    foreign = write_identity(trustme.CA(), tls_cluster.tmp, "foreign")  # a valid cert from another CA
    with pytest.raises(grpc.aio.AioRpcError) as e:
        stats(address, foreign)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    kv = tls_cluster.worker("decode-0").worker.kv_address  # the KV endpoint too
    with pytest.raises(grpc.aio.AioRpcError):
        stats(kv, None)


def test_incomplete_tls_settings_are_named(tmp_path):
    with pytest.raises(TLSConfigError, match="key_file"):
        TLSConfig(cert_file="c.pem", ca_file="ca.pem").server_credentials()
    with pytest.raises(TLSConfigError, match="cannot read"):
        TLSConfig(str(tmp_path / "no.pem"), str(tmp_path / "no.key"), str(tmp_path / "ca.pem")).server_credentials()
