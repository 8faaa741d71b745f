"""LoRA adapters through `pdserve up` under Ray (one prefill and one decode worker): an adapter
given with --lora-modules is listed by /v1/models with its parent and its requests equal the
single engine's under the same adapter (prefilled remotely, the hand-off under the adapter); an
adapter loaded at run time reaches both workers; each worker's own /metrics serves the
model-server series; every KV block is back in its pool after."""

import os

import httpx
import pytest

from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.config import CacheConfig, EngineConfig, LoRAConfig
from pdserve.engine.core.engine import LLMEngine
from pdserve.registry.embedded import free_port
from tests.helpers.procs import Proc, stop, wait_kv_back

pytestmark = [pytest.mark.slow, pytest.mark.ray]
pytest.importorskip("peft")

PROMPT = "Write a short poem about the harbour at dawn."
N = 10


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    from pdserve.engine.model.export import export_hf
    from tests.helpers.lora import make_adapter

    root = tmp_path_factory.mktemp("up-adapters")
    export_hf("", root / "hf")
    make_adapter(root / "hf", root / "sql", seed=3, scale=0.5)
    make_adapter(root / "hf", root / "chat", seed=5, r=4, targets=["q_proj", "v_proj"], scale=0.5)
    return {"sql": str(root / "sql"), "chat": str(root / "chat")}


def test_up_serves_adapters_given_at_start_and_loaded_at_run_time(smollm, adapters):
    loaded, tok = smollm
    eng = LLMEngine(loaded, EngineConfig(cache=CacheConfig(kv_cache_memory=32 << 20),
                                         lora=LoRAConfig(max_loras=2, modules=tuple(adapters.items()))), tok)
    params = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)
    want = {}
    for lora in ("sql", "chat"):
        eng.add_request(lora, tok.encode(PROMPT), params, lora=lora)
    while eng.has_unfinished_requests():
        for o in eng.step():
            want.setdefault(o.request_id, []).extend(o.new_token_ids)
    port, metrics_port = free_port(), free_port()
    up = Proc("up", "--port", str(port), "--prefill", "1", "--decode", "1", "--kv-cache-memory", "64MiB",
              "--lora-modules", f"sql={adapters['sql']}", "--max-loras", "2", "--cluster-token", "test-token",
              "--shutdown-grace", "3", "--worker-metrics-port", str(metrics_port))
    url = f"http://127.0.0.1:{port}"
    try:
        line = up.p.stdout.readline()
        assert line.startswith("curl "), up.text() if up.p.poll() is not None else line
        models = httpx.get(url + "/v1/models", timeout=10).json()["data"]
        base = models[0]["id"]
        assert [(m["id"], m["parent"]) for m in models] == [(base, None), ("sql", base)]

        def complete(model):
            r = httpx.post(url + "/v1/completions", timeout=120, json={
                "model": model, "prompt": tok.encode(PROMPT), "max_tokens": N, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]
        assert complete("sql") == tok.decode(want["sql"], skip_special_tokens=True)
        r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": adapters["chat"]},
                       timeout=120)
        assert r.status_code == 200, r.text
        assert complete("chat") == tok.decode(want["chat"], skip_special_tokens=True)
        workers = httpx.get(url + "/admin/workers", timeout=10).json()["workers"]
        assert len(workers) == 2
        # the port asked for, on one of them; the other (the same host) took a free one
        assert metrics_port in {w["metrics_port"] for w in workers} and len({w["metrics_port"] for w in workers}) == 2
        for w in workers:
            assert sorted(a["name"] for a in w["lora_adapters"]) == ["chat", "sql"]
            host = w["address"].rpartition(":")[0]
            text = httpx.get(f"http://{host}:{w['metrics_port']}/metrics", timeout=10).text
            assert "vllm:num_requests_waiting{" in text and 'max_lora="2"' in text
            if w["role"] == "decode":
                # its steps ran while the prefill worker was idle: on its thread and the peer's
                threads = min(2, len(os.sched_getaffinity(0)))
                assert f'pdserve:step_threads{{model_name="{base}"}} {threads:.1f}' in text, text
        wait_kv_back(url, 2)  # every KV block back in its pool, in both workers
    finally:
        rc = stop(up)
    assert rc == 0, up.text()
