"""The engine's LoRA registry and loader: load and unload by name, a bound on resident adapters
(least recently used idle one dropped, never one a request uses, dropped ones loaded again on
demand), ids, named errors for bad adapters, and the block-hash root under an adapter."""
import json

import pytest
import torch

from pdserve.common.block_hash import ROOT_HASH, root_hash
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.config import CacheConfig, EngineConfig, LoRAConfig
from pdserve.engine.core.engine import LLMEngine
from pdserve.engine.core.lora_registry import LoRACapacityError, LoRAInUseError, LoRANotFoundError
from pdserve.engine.model.lora import (LoRAError, LoRAFilesMissingError, LoRARankError, LoRAShapeError,
                                       LoRAUnsupportedError)
from pdserve.engine.model.weights import load_model
from tests.conftest import assert_engine_clean
from tests.helpers.lora import make_adapter, save_small_llama

pytest.importorskip("peft")

PARAMS = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """A base and three adapters a, b, c on it (rank 4, q and v)."""
    root = tmp_path_factory.mktemp("loras")
    base = save_small_llama(root / "base")
    for seed, name in enumerate("abc"):
        make_adapter(base, root / name, seed=seed + 1, r=4, alpha=8, targets=["q_proj", "v_proj"])
    return root


@pytest.fixture
def engine(dirs):
    made = []

    def factory(max_loras=2, max_lora_rank=16, modules=()):
        eng = LLMEngine(load_model(dirs / "base", quantization="none"), EngineConfig(
            quantization="none", cache=CacheConfig(kv_cache_memory=8 << 20),
            lora=LoRAConfig(max_loras, max_lora_rank, modules)))
        made.append(eng)
        return eng
    yield factory
    for eng in made:
        assert_engine_clean(eng)
        assert eng.loras.in_use == 0


def finish(eng):
    while eng.has_unfinished_requests():
        eng.step()


def test_load_unload_and_ids(engine, dirs):
    eng = engine(modules=(("a", str(dirs / "a")),))
    info = eng.load_lora("b", str(dirs / "b"))
    assert (info.name, info.resident, info.rank, info.users) == ("b", True, 4, 0)
    ids = {i.name: i.id for i in eng.loras.adapters()}
    assert sorted(ids) == ["a", "b"] and len(set(ids.values())) == 2 and 0 not in ids.values()
    eng.unload_lora("a")
    assert [i.name for i in eng.loras.adapters()] == ["b"]
    with pytest.raises(LoRANotFoundError, match="unknown LoRA adapter 'a'.*loaded: b"):
        eng.add_request("r", [5, 6, 7], PARAMS, lora="a")
    with pytest.raises(LoRANotFoundError):
        eng.unload_lora("a")
    assert not eng.has_unfinished_requests()


def test_lru_bound_drops_the_least_recently_used_idle_adapter(engine, dirs):
    eng = engine(max_loras=2)
    for name in "ab":
        eng.load_lora(name, str(dirs / name))
    eng.add_request("r", [5, 6, 7], PARAMS, lora="a")  # a: most recently used, and in use
    assert eng.scheduler.requests["r"].cache_root == eng.cache_root("", "a") != eng.cache_root()
    identity = eng.loras.identity("b")
    eng.load_lora("c", str(dirs / "c"))  # drops b, the idle one
    assert [(i.name, i.resident) for i in eng.loras.adapters()] == [("a", True), ("c", True), ("b", False)]
    assert eng.loras.evictions == 1
    finish(eng)
    # b is known still: a request naming it loads it again (a new id), dropping a (least recent)
    loads = eng.loras.loads
    eng.add_request("s", [5, 6, 7], PARAMS, lora="b")
    assert eng.loras.loads == loads + 1 and not eng.loras.get("a") and eng.loras.get("b").id > 3
    assert eng.loras.get("b").identity == identity  # the same files: its cached blocks still match
    finish(eng)


def test_an_adapter_in_use_is_never_dropped(engine, dirs):
    eng = engine(max_loras=2, modules=(("a", str(dirs / "a")), ("b", str(dirs / "b"))))
    eng.add_request("r", [5, 6, 7], PARAMS, lora="a")
    eng.add_request("s", [5, 6, 7], PARAMS, lora="b")
    with pytest.raises(LoRACapacityError, match="all 2 resident adapters are in use"):
        eng.load_lora("c", str(dirs / "c"))
    with pytest.raises(LoRAInUseError):
        eng.unload_lora("a")
    with pytest.raises(LoRAInUseError):
        eng.load_lora("a", str(dirs / "c"))
    assert {i.name: i.users for i in eng.loras.adapters()} == {"a": 1, "b": 1}
    eng.abort("r")  # an aborted request gives its adapter back too
    finish(eng)
    eng.load_lora("c", str(dirs / "c"))
    assert sorted(i.name for i in eng.loras.adapters() if i.resident) == ["b", "c"]


def test_a_failed_replacement_keeps_the_adapter(engine, dirs, tmp_path):
    eng = engine(modules=(("a", str(dirs / "a")),))
    with pytest.raises(LoRAFilesMissingError):
        eng.load_lora("a", str(tmp_path / "nowhere"))
    assert eng.loras.get("a") is not None and eng.loras.adapters()[0].path == str(dirs / "a")


def test_lora_off_refuses_adapters(engine, dirs):
    eng = engine(max_loras=0)
    with pytest.raises(LoRAError, match="LoRA is off"):
        eng.load_lora("a", str(dirs / "a"))
    with pytest.raises(LoRANotFoundError):
        eng.add_request("r", [5, 6, 7], PARAMS, lora="a")


def test_bad_adapters_give_named_errors(engine, dirs, tmp_path):
    eng = engine()
    with pytest.raises(LoRAFilesMissingError, match="does not exist"):
        eng.load_lora("x", str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "adapter_config.json").write_text("{}")
    with pytest.raises(LoRAFilesMissingError, match="adapter_model.safetensors"):
        eng.load_lora("x", str(tmp_path / "empty"))
    # made on a base of another width: every tensor's shape is wrong for this one
    other = save_small_llama(tmp_path / "other-base", hidden_size=32)
    make_adapter(other, tmp_path / "other", seed=1, r=4, targets=["q_proj"])
    with pytest.raises(LoRAShapeError, match="shape .* this base expects"):
        eng.load_lora("x", str(tmp_path / "other"))
    make_adapter(dirs / "base", tmp_path / "head", seed=1, r=4, targets=["lm_head"])
    with pytest.raises(LoRAUnsupportedError, match="lm_head"):
        eng.load_lora("x", str(tmp_path / "head"))
    make_adapter(dirs / "base", tmp_path / "dora", seed=1, r=4, targets=["q_proj"], use_dora=True)
    with pytest.raises(LoRAUnsupportedError, match="DoRA"):
        eng.load_lora("x", str(tmp_path / "dora"))
    make_adapter(dirs / "base", tmp_path / "wide", seed=1, r=32, targets=["q_proj"])
    with pytest.raises(LoRARankError, match="rank 32 is above this engine's max_lora_rank \\(16\\)"):
        eng.load_lora("x", str(tmp_path / "wide"))
    assert eng.loras.adapters() == []


def test_bad_config_fields_and_tensors(engine, dirs, tmp_path):
    import shutil

    eng = engine()
    bad = tmp_path / "bad"
    shutil.copytree(dirs / "a", bad)
    config = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps(config | {"target_modules": ["q_proj", "embed_tokens"]}))
    with pytest.raises(LoRAUnsupportedError, match="embed_tokens"):
        eng.load_lora("x", str(bad))
    (bad / "adapter_config.json").write_text(json.dumps(config | {"peft_type": "IA3"}))
    with pytest.raises(LoRAUnsupportedError, match="IA3"):
        eng.load_lora("x", str(bad))
    (bad / "adapter_config.json").write_text(json.dumps(config))
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(bad / "adapter_model.safetensors"))
    save_file({k: v for k, v in tensors.items() if "lora_B" not in k or "layers.0.self_attn.q_proj" not in k},
              str(bad / "adapter_model.safetensors"))
    with pytest.raises(LoRAShapeError, match="layer 0 q_proj has lora_A but not its pair"):
        eng.load_lora("x", str(bad))
    (bad / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(LoRAError, match="not a safetensors file"):
        eng.load_lora("x", str(bad))


def test_root_hash_under_an_adapter():
    assert root_hash() == ROOT_HASH and root_hash("", "") == ROOT_HASH
    roots = {root_hash("", "a@1"), root_hash("", "a@2"), root_hash("", "b@1"), root_hash("t", "a@1"),
             root_hash("t"), root_hash("a@1"), ROOT_HASH}
    assert len(roots) == 7  # salt, adapter name and digest each change the chain
    assert root_hash("t", "a@1") == root_hash("t", "a@1")


def test_the_update_lands_on_its_own_slice(dirs):
    """An adapter on v_proj alone changes only the v columns of the fused q/k/v output."""
    from pdserve.engine.model.lora import load_adapter
    from pdserve.engine.model.lora_batch import LoRABatch

    loaded = load_model(dirs / "base", quantization="none")
    cfg = loaded.config
    adapter = load_adapter("a", dirs / "a", cfg, 16)  # q and v
    adapter.id = 1
    x = torch.randn(5, cfg.hidden_size)
    y = torch.zeros(5, (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim)
    batch = LoRABatch.of_spans([(0, 2, adapter), (2, 5, None)], 5)
    batch.layer(0).add("qkv", x, y)
    nq, nk = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    assert y[2:].abs().max() == 0, "rows of the base got an update"
    assert y[:2, nq:nq + nk].abs().max() == 0, "k_proj is not a target"
    from safetensors.torch import load_file
    t = load_file(str(dirs / "a" / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.0.self_attn.{}_proj.lora_{}.weight"
    for proj, cols in (("q", slice(0, nq)), ("v", slice(nq + nk, None))):
        want = x[:2] @ t[key.format(proj, "A")].T @ t[key.format(proj, "B")].T * (8 / 4)  # alpha / r
        torch.testing.assert_close(y[:2, cols], want, atol=1e-5, rtol=1e-5)


def test_lora_config_reads_back_from_json():
    """A tensor-parallel rank rebuilds the EngineConfig from asdict's JSON (engine/parallel/tp.py)."""
    from dataclasses import asdict

    cfg = EngineConfig(lora=LoRAConfig(max_loras=2, max_lora_rank=8, modules=(("a", "/adapters/a"),)))
    back = json.loads(json.dumps(asdict(cfg)))
    assert EngineConfig(**(back | {"cache": cfg.cache, "scheduler": cfg.scheduler})) == cfg
