"""LoRA adapters through the cluster (issue 30): a prefill worker, a decode worker and the router
in process, on the real default model with PEFT adapters made on its HF export. An adapter's
request equals the single engine under the same adapter, interleaved with base requests and
prefilled remotely; prefix hits never cross adapters (the router's index and the workers'
caches); a hand-off computed under another adapter is refused; the admin endpoints load and
unload adapters on every worker with clear JSON errors; /v1/models lists adapters with their
parent. Pure parts (model resolution, the routing preference) are tested alone first."""
from __future__ import annotations

import asyncio
import concurrent.futures
import time

import httpx
import pytest

from pdserve.common.errors import KVTransferError
from pdserve.common.sampling_params import SamplingParams
from pdserve.config import SecurityConfig
from pdserve.deploy.local import LocalCluster
from pdserve.engine.config import CacheConfig, EngineConfig, LoRAConfig
from pdserve.engine.core.engine import LLMEngine
from pdserve.kv_transfer.grpc_transport import GrpcKVSender, GrpcKVServer
from pdserve.kv_transfer.receiver import KVReceiver
from pdserve.protos import worker_pb2 as pb
from pdserve.router.adapters import model_cards, resolve_model
from pdserve.router.errors import APIError
from pdserve.router.policies import WorkerLoad, prefer_adapter
from tests.helpers.clusters import MODEL, local_config

pytest.importorskip("peft")
KEY = "admin-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
N = 8
PROMPTS = ["Write a haiku about the ocean.", "List three prime numbers."]


# ---- pure parts ----------------------------------------------------------------------------
def test_a_model_resolves_to_the_base_an_adapter_or_a_404_naming_the_served_ones():
    adapters = {"sql": pb.LoRAAdapterInfo(name="sql", path="/a/sql", identity="sql@1")}
    assert resolve_model("base", "base", adapters) == ""
    assert resolve_model("sql", "base", adapters) == "sql"
    with pytest.raises(APIError) as e:
        resolve_model("nope", "base", adapters)
    assert (e.value.status, e.value.code) == (404, "model_not_found")
    assert "'base', 'sql'" in str(e.value)
    cards = model_cards("base", 5, adapters)
    assert [(c["id"], c["parent"], c["root"]) for c in cards] == [("base", None, "base"), ("sql", "base", "/a/sql")]


def test_routing_prefers_workers_holding_the_adapter_unless_short_of_kv():
    loads = [WorkerLoad("a", running=3), WorkerLoad("b", running=0), WorkerLoad("c", kv_usage=0.95)]
    assert [w.worker_id for w in prefer_adapter(loads, {"a"})] == ["a"]
    assert [w.worker_id for w in prefer_adapter(loads, {"c"})] == ["a", "b", "c"]  # near full: any
    assert prefer_adapter(loads, set()) == loads  # the base model, or nobody holds it
    down = [WorkerLoad("a", healthy=False)] + loads[1:]
    assert prefer_adapter(down, {"a"}) == down  # its holder is down: any (the policy skips the unhealthy)


def test_a_handoff_computed_under_another_adapter_is_refused():
    import torch
    fp, layout = "m", (2, 2, 16, 2, 16)
    kv = torch.randn(2, 2, 3, 16, 2, 16)

    async def push(rx, identity):
        server, sender = GrpcKVServer(rx), GrpcKVSender("prefill-0")
        addr = await server.start()
        try:
            await sender.push(addr, "r1", kv, dest_block_ids=[3, 4, 5], num_tokens=40, first_token=7,
                              model_fingerprint=fp, timeout_s=10.0, lora_identity=identity)
        finally:
            await sender.close()
            await server.stop()
    for lease, sent in (("sql@1", ""), ("sql@1", "sql@2"), ("", "sql@1"), ("sql@1", "chat@1")):
        rx = KVReceiver(fp, layout)
        rx.expect("r1", [3, 4, 5], 40, timeout_s=30, lora_identity=lease)
        with pytest.raises(KVTransferError, match="computed under adapter"):
            asyncio.run(push(rx, sent))
        assert rx.take_ready() == []
    rx = KVReceiver(fp, layout)
    rx.expect("r1", [3, 4, 5], 40, timeout_s=30, lora_identity="sql@1")
    asyncio.run(push(rx, "sql@1"))
    assert rx.take("r1") is not None


def test_lora_flags_become_the_engine_lora_config():
    import argparse

    from pdserve.flags import lora_config
    ns = argparse.Namespace(lora_modules=["sql=/a/sql", " chat = /a/chat "], max_loras=None, max_lora_rank=32)
    assert lora_config(ns) == LoRAConfig(max_loras=2, max_lora_rank=32, modules=(("sql", "/a/sql"), ("chat", "/a/chat")))
    assert lora_config(argparse.Namespace(lora_modules=[], max_loras=None, max_lora_rank=16)).max_loras == 0
    with pytest.raises(ValueError, match="NAME=PATH"):
        lora_config(argparse.Namespace(lora_modules=["sql"], max_loras=4, max_lora_rank=16))
    with pytest.raises(ValueError, match="more than lora.max_loras"):
        lora_config(argparse.Namespace(lora_modules=["a=/a", "b=/b"], max_loras=1, max_lora_rank=16))


# ---- through the cluster -------------------------------------------------------------------
@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """Two adapters on the exported default model: "sql" (every projection, rank 8) and "chat"
    (q, v and down at rank 4)."""
    from pdserve.engine.model.export import export_hf
    from tests.helpers.lora import make_adapter

    root = tmp_path_factory.mktemp("adapters")
    export_hf("", root / "hf")
    make_adapter(root / "hf", root / "sql", seed=3, scale=0.5)
    make_adapter(root / "hf", root / "chat", seed=5, r=4, targets=["q_proj", "v_proj", "down_proj"], scale=0.5)
    return {"sql": str(root / "sql"), "chat": str(root / "chat")}


@pytest.fixture(scope="module")
def expected(smollm, adapters):
    """Greedy tokens of each prompt under the base and each adapter, by one engine."""
    loaded, tok = smollm
    eng = LLMEngine(loaded, EngineConfig(cache=CacheConfig(kv_cache_memory=32 << 20), lora=LoRAConfig(
        max_loras=2, modules=tuple(adapters.items()))), tok)
    params = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
    out = {}
    for i, text in enumerate(PROMPTS):
        for lora in (None, "sql", "chat"):
            rid = f"{i}-{lora}"
            eng.add_request(rid, tok.encode(text), params, lora=lora)
            out[(text, lora or MODEL)] = rid
    toks = {rid: [] for rid in out.values()}
    while eng.has_unfinished_requests():
        for o in eng.step():
            toks[o.request_id].extend(o.new_token_ids)
    assert eng.blocks.num_used_blocks == 0
    want = {k: toks[rid] for k, rid in out.items()}
    assert want[(PROMPTS[0], "sql")] != want[(PROMPTS[0], MODEL)] != want[(PROMPTS[0], "chat")]
    return want


@pytest.fixture(scope="module")
def cluster(smollm, adapters):
    loaded, tok = smollm
    cfg = local_config(64 << 20, security=SecurityConfig(api_keys=(KEY,)), engine=EngineConfig(
        cache=CacheConfig(kv_cache_memory=64 << 20),
        lora=LoRAConfig(max_loras=2, modules=(("sql", adapters["sql"]),))))
    c = LocalCluster(loaded, tok, cfg).start()
    yield c
    c.stop()
    for eng in c.engines():
        assert eng.blocks.num_used_blocks == 0 and not eng.has_unfinished_requests()
        assert eng.loras.in_use == 0


def complete(cluster, model: str, text: str) -> dict:
    r = httpx.post(cluster.url + "/v1/completions", headers=AUTH, timeout=120, json={
        "model": model, "prompt": cluster.tokenizer.encode(text), "max_tokens": N, "temperature": 0,
        "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def text_of(body: dict) -> str:
    return body["choices"][0]["text"]


def decoded(cluster, ids: list[int]) -> str:
    return cluster.tokenizer.decode(ids, skip_special_tokens=True)


def test_adapter_and_base_requests_interleaved_equal_the_single_engine(cluster, expected):
    decode = cluster.worker("decode-0").worker
    before = decode.remote_prefills
    jobs = [(m, t) for t in PROMPTS for m in (MODEL, "sql")] * 2
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda j: complete(cluster, *j), jobs))
    for (model, text), body in zip(jobs, got):
        assert body["model"] == model
        assert text_of(body) == decoded(cluster, expected[(text, model)]), (model, text)
    assert decode.remote_prefills - before == len(jobs)  # disaggregated: every prompt from the prefill worker


def test_prefix_hits_never_cross_adapters(cluster, smollm):
    tok = smollm[1]
    text = "Name the planets of the solar system in order, with one fact about each of them. " * 3
    ids = tok.encode(text)
    base = complete(cluster, MODEL, text)
    assert base["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) == 0
    router = cluster.router.cluster

    async def route(lora):
        r = router.route(ids, lora=lora)
        router.release(r)
        return r
    cluster.run(asyncio.sleep(0.3))  # the router's index follows the workers' view
    on_base, on_sql = cluster.run(route("")), cluster.run(route("sql"))
    assert on_base.block_hashes != on_sql.block_hashes  # another root: never the same blocks
    assert not any(router.index.match(on_sql.block_hashes).values())
    sql = complete(cluster, "sql", text)
    assert sql["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) == 0  # the base's blocks: no hit
    again = complete(cluster, "sql", text)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # its own blocks: a hit
    assert text_of(again) == text_of(sql)


def test_models_list_adapters_with_their_parent_and_workers_report_them(cluster, adapters):
    r = httpx.get(cluster.url + "/v1/models", headers=AUTH)
    assert [(m["id"], m["parent"]) for m in r.json()["data"]] == [(MODEL, None), ("sql", MODEL)]
    assert httpx.get(cluster.url + "/v1/models/sql", headers=AUTH).json()["root"] == adapters["sql"]
    for s in cluster.router.cluster.stats.values():
        assert [(i.name, i.identity.startswith("sql@")) for i in s.loras] == [("sql", True)]
        assert s.max_loras == 2
    r = httpx.post(cluster.url + "/v1/completions", headers=AUTH, json={"model": "nope", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert "'sql'" in r.json()["error"]["message"]


def test_load_and_unload_on_every_worker_with_clear_errors(cluster, adapters, expected, tmp_path):
    url = cluster.url
    body = {"lora_name": "chat", "lora_path": adapters["chat"]}
    assert httpx.post(url + "/v1/load_lora_adapter", json=body).status_code == 401  # admin key needed
    r = httpx.post(url + "/v1/load_lora_adapter", headers=AUTH, json={"lora_name": "bad", "lora_path": str(tmp_path)})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_adapter", r.text
    assert "adapter_config.json" in r.json()["error"]["message"] or "no" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/load_lora_adapter", headers=AUTH, json={"lora_name": "chat"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    r = httpx.post(url + "/v1/load_lora_adapter", headers=AUTH, json=body)
    assert r.status_code == 200, r.text
    for eng in cluster.engines():
        assert "chat" in {i.name for i in eng.loras.adapters()}
    for text in PROMPTS:
        assert text_of(complete(cluster, "chat", text)) == decoded(cluster, expected[(text, "chat")])
    # a worker that lost it (as one started later lacks it) is given it again by the router
    decode = cluster.worker("decode-0")
    cluster.run(decode.worker.engine.unload_lora("chat"))
    deadline = time.monotonic() + 30
    while "chat" not in {i.name for i in decode.engine.loras.adapters()} and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "chat" in {i.name for i in decode.engine.loras.adapters()}
    r = httpx.post(url + "/v1/unload_lora_adapter", headers=AUTH, json={"lora_name": "missing"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(url + "/v1/unload_lora_adapter", headers=AUTH, json={"lora_name": "chat"})
    assert r.status_code == 200, r.text
    r = httpx.post(url + "/v1/completions", headers=AUTH, json={"model": "chat", "prompt": "hi"})
    assert r.status_code == 404
    assert cluster.router.adapters.unwanted == {"chat"} and not cluster.router.adapters.wanted


def test_each_worker_serves_the_model_server_metrics_and_the_router_counts_per_adapter(cluster):
    import re
    import threading

    decode = cluster.worker("decode-0")
    view = httpx.get(cluster.url + "/admin/workers", headers=AUTH).json()["workers"]
    assert {w["worker_id"]: w["metrics_port"] for w in view} == {
        w.record.worker_id: w.record.metrics_port for w in cluster.workers}
    assert all(w["metrics_port"] > 0 and [a["name"] for a in w["lora_adapters"]] == ["sql"] for w in view)
    for w in cluster.workers:
        text = httpx.get(f"http://127.0.0.1:{w.record.metrics_port}/metrics").text
        for series in ("vllm:num_requests_waiting{model_name=", "vllm:num_requests_running{model_name=",
                       "vllm:kv_cache_usage_perc{model_name=", 'vllm:cache_config_info{block_size="16"',
                       'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}'):
            assert series in text, (w.record.worker_id, series)
    # a long request under the adapter: the decode worker's gauge names it while it runs
    long = threading.Thread(target=lambda: httpx.post(cluster.url + "/v1/completions", headers=AUTH, timeout=120, json={
        "model": "sql", "prompt": "Count to one hundred:", "max_tokens": 96, "temperature": 0, "ignore_eos": True}))
    long.start()
    seen, deadline = "", time.monotonic() + 60
    while time.monotonic() < deadline and not seen:
        text = httpx.get(f"http://127.0.0.1:{decode.record.metrics_port}/metrics").text
        m = re.search(r'vllm:lora_requests_info\{max_lora="2",running_lora_adapters="sql"', text)
        seen = m.group(0) if m else ""
        time.sleep(0.05)
    long.join()
    assert seen
    text = httpx.get(cluster.url + "/metrics").text
    assert re.search(r'pdserve_model_requests_total\{model="sql",status="length"\} [1-9]', text)
    assert re.search(rf'pdserve_model_requests_total\{{model="{MODEL}",status="length"\}} [1-9]', text)
