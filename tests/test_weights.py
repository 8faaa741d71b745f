"""GGUF and Hugging Face loading on small files written here: every supported tensor type,
the Q/K permutation, the conversion cache, and clear errors."""
import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.quants import quantize
from safetensors.torch import save_file

from pdserve.common.errors import ModelLoadError
from pdserve.engine.model.tiny import tiny_config, tiny_state_dict
from pdserve.engine.model.weights import _GGUF_LAYER_NAMES, load_model

HF_TO_GGUF = {v: k for k, v in _GGUF_LAYER_NAMES.items()}


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q_proj/k_proj rows (the loader must undo it)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, cfg, state, qtype=Q.F32, arch="llama", skip=()):
    w = GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_vocab_size(cfg.vocab_size)
    for name, t in state.items():
        if name in skip:
            continue
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            parts = name.split(".")
            gname = f"blk.{parts[2]}.{HF_TO_GGUF['.'.join(parts[3:-1])]}.weight"
        arr = t.numpy().astype(np.float32)
        if name.endswith("q_proj.weight"):
            arr = llama_cpp_permute(arr, cfg.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            arr = llama_cpp_permute(arr, cfg.num_key_value_heads)
        if arr.ndim == 1 or qtype == Q.F32:
            w.add_tensor(gname, arr)
        elif qtype == Q.F16:
            w.add_tensor(gname, arr.astype(np.float16))
        else:
            w.add_tensor(gname, quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# max abs error bound relative to each tensor's max magnitude, per type
TOLERANCE = {Q.F32: 0.0, Q.F16: 1e-3, Q.Q8_0: 1e-2, Q.Q4_0: 0.15, Q.Q4_1: 0.1}


@pytest.mark.parametrize("qtype", list(TOLERANCE), ids=lambda q: q.name)
def test_gguf_types_load_and_unpermute(tmp_path, qtype, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    cfg = tiny_config()
    state = tiny_state_dict(cfg, seed=3)
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    write_gguf(path, cfg, state, qtype)
    loaded = load_model(path)
    assert loaded.config.num_hidden_layers == cfg.num_hidden_layers
    assert not loaded.config.tie_word_embeddings
    ours = loaded.model.state_dict()
    for name, ref in state.items():
        err = (ours[name] - ref).abs().max().item()
        bound = TOLERANCE[qtype] * ref.abs().max().item()
        assert err <= bound + 1e-7, f"{name}: {qtype.name} error {err:.3g} > {bound:.3g}"
    # the conversion cache is written, used on the second load, and gives the same weights
    assert len(list((tmp_path / "cache").glob("*.safetensors"))) == 1
    import pdserve.engine.model.weights
    monkeypatch.setattr(pdserve.engine.model.weights, "read_gguf_state_dict", lambda p: pytest.fail("cache not used"))
    again = load_model(path).model.state_dict()
    assert all(torch.equal(again[k], ours[k]) for k in ours)


def test_the_conversion_cache_keeps_one_file_per_model_file_that_exists(tmp_path, monkeypatch):
    """A model file that changes, or is deleted, leaves no stale conversion behind (each is as
    big as the model's fp32 weights): the next conversion removes them; others stay."""
    import os

    cache = tmp_path / "cache"
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(cache))
    cfg = tiny_config()
    a, b, gone = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "gone.gguf"
    for path in (a, b, gone):
        write_gguf(path, cfg, tiny_state_dict(cfg))
        load_model(path)
    assert len(list(cache.glob("*.safetensors"))) == 3
    gone.unlink()
    write_gguf(a, cfg, tiny_state_dict(cfg, seed=5))  # a new version of a
    os.utime(a, ns=(a.stat().st_atime_ns, a.stat().st_mtime_ns + 10**9))
    load_model(a)
    left = sorted(p.name.split("-")[0] for p in cache.glob("*.safetensors"))
    assert left == ["a", "b"]  # a's new conversion and b's; a's old one and gone's are removed
    torch.testing.assert_close(load_model(a).model.state_dict()["lm_head.weight"],
                               tiny_state_dict(cfg, seed=5)["lm_head.weight"])


def test_tied_embeddings_when_no_output_tensor(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    cfg = tiny_config(tie_word_embeddings=True)
    state = tiny_state_dict(cfg)
    write_gguf(tmp_path / "tied.gguf", cfg, state)
    loaded = load_model(tmp_path / "tied.gguf")
    assert loaded.config.tie_word_embeddings
    assert loaded.model.lm_head.weight.data_ptr() == loaded.model.model.embed_tokens.weight.data_ptr()


def test_unknown_architecture_is_named(tmp_path):
    cfg = tiny_config()
    write_gguf(tmp_path / "m.gguf", cfg, tiny_state_dict(cfg), arch="gpt2")
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'gpt2'"):
        load_model(tmp_path / "m.gguf")


def test_missing_tensor_is_named(tmp_path):
    cfg = tiny_config()
    write_gguf(tmp_path / "m.gguf", cfg, tiny_state_dict(cfg), skip={"model.layers.1.mlp.up_proj.weight"})
    with pytest.raises(ModelLoadError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        load_model(tmp_path / "m.gguf")


def write_hf_dir(path, cfg, state, config_overrides=None):
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps({**cfg.to_hf_dict(), **(config_overrides or {})}))
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))


def test_hf_dir_round_trip(tmp_path):
    cfg = tiny_config()
    state = tiny_state_dict(cfg, seed=5)
    write_hf_dir(tmp_path / "m", cfg, state)
    ours = load_model(tmp_path / "m").model.state_dict()
    assert all(torch.equal(ours[k], v) for k, v in state.items())


def test_shape_mismatch_is_named(tmp_path):
    cfg = tiny_config()
    state = tiny_state_dict(cfg)
    state["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(64, 32)
    write_hf_dir(tmp_path / "m", cfg, state)
    with pytest.raises(ModelLoadError, match=r"'model\.layers\.0\.self_attn\.o_proj\.weight' has shape \(64, 32\)"):
        load_model(tmp_path / "m")


def test_unexpected_tensor_and_architecture_in_hf_dir(tmp_path):
    cfg = tiny_config()
    state = tiny_state_dict(cfg)
    write_hf_dir(tmp_path / "a", cfg, {**state, "model.layers.0.mlp.extra.weight": torch.zeros(2)})
    with pytest.raises(ModelLoadError, match="unexpected tensor 'model.layers.0.mlp.extra.weight'"):
        load_model(tmp_path / "a")
    write_hf_dir(tmp_path / "b", cfg, state, {"model_type": "gpt_neox"})
    with pytest.raises(ValueError, match="unsupported architecture 'gpt_neox'"):
        load_model(tmp_path / "b")


def test_bad_paths(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope.gguf")
    (tmp_path / "x.bin").write_bytes(b"\0")
    with pytest.raises(ModelLoadError, match="expected a .gguf"):
        load_model(tmp_path / "x.bin")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(tmp_path / "empty")


def test_fingerprint_follows_content_not_location(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    cfg = tiny_config()
    write_gguf(tmp_path / "a.gguf", cfg, tiny_state_dict(cfg, seed=1))
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "b.gguf").write_bytes((tmp_path / "a.gguf").read_bytes())
    write_gguf(tmp_path / "c.gguf", cfg, tiny_state_dict(cfg, seed=2))
    a, b, c = (load_model(p).fingerprint for p in (tmp_path / "a.gguf", tmp_path / "elsewhere" / "b.gguf", tmp_path / "c.gguf"))
    assert a == b != c


def _reader_metadata(reader, vocab: bool = False) -> dict:
    """What gguf's own reader finds in the file's metadata, as `gguf_header` gives it (the
    vocabulary's arrays by their length unless `vocab`)."""
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):  # the reader's own records of the header (version, counts)
            continue
        if not vocab and key.startswith("tokenizer.ggml.") and key.rsplit(".", 1)[-1] in (
                "tokens", "merges", "token_type", "scores"):
            out[f"{key}.count"] = len(field.data)
        else:
            out[key] = field.contents()
    return out


def _same_tensors_as_the_reader(path, reader) -> None:
    """The loader's views of every tensor hold what gguf's reader finds: name, type, shape
    and every value (plain numbers in this machine's byte order)."""
    from pdserve.engine.model.weights import _gguf_arrays

    _, ours = _gguf_arrays(path)
    assert [t[0] for t in ours] == [t.name for t in reader.tensors]
    for (name, kind, data, shape), want in zip(ours, reader.tensors):
        assert kind == want.tensor_type and data.shape == want.data.shape, name
        assert shape == tuple(reversed([int(x) for x in want.shape])), name
        assert np.array_equal(data, np.asarray(want.data)) and data.dtype.isnative, name


@pytest.mark.parametrize("endian", ["little", "big"])
def test_the_header_reader_reads_every_value_type_as_gguf_does(tmp_path, endian):
    from gguf import GGUFEndian, GGUFReader

    from pdserve.engine.model.gguf_config import gguf_header

    path = tmp_path / "kinds.gguf"
    w = GGUFWriter(str(path), "llama", endianess=GGUFEndian.BIG if endian == "big" else GGUFEndian.LITTLE)
    w.add_uint8("k.u8", 200), w.add_int8("k.i8", -5), w.add_uint16("k.u16", 60000), w.add_int16("k.i16", -300)
    w.add_uint32("k.u32", 4_000_000_000), w.add_int32("k.i32", -7), w.add_float32("k.f32", 0.25)
    w.add_uint64("k.u64", 2**40), w.add_int64("k.i64", -(2**40)), w.add_float64("k.f64", 1e-300)
    w.add_bool("k.bool", True), w.add_string("k.str", "ünïcode")
    w.add_array("k.ints", [3, 1, 4]), w.add_array("k.strs", ["a", "", "bc"]), w.add_array("k.floats", [0.5, 1.5])
    w.add_token_list(["<s>", "a", "ab"]), w.add_token_scores([0.0, -1.0, -2.0]), w.add_token_merges(["a b"])
    w.add_tensor("t", np.arange(4, dtype=np.float32) - 1.5)
    w.add_tensor("h", np.arange(6, dtype=np.float16).reshape(2, 3))
    w.add_tensor("i", np.arange(8, dtype=np.int32) * -3)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    reader = GGUFReader(str(path))
    got = gguf_header(path)
    assert got == _reader_metadata(reader)
    assert got["k.u64"] == 2**40 and got["k.str"] == "ünïcode" and got["k.strs"] == ["a", "", "bc"]
    assert got["tokenizer.ggml.tokens.count"] == 3 and "tokenizer.ggml.tokens" not in got
    full = gguf_header(path, vocab=True)
    assert full == _reader_metadata(reader, vocab=True) and full["tokenizer.ggml.tokens"] == ["<s>", "a", "ab"]
    _same_tensors_as_the_reader(path, reader)


def test_the_header_reader_gives_the_real_model_s_metadata_config_and_tensors(smollm):
    """And the tokenizer built from it (no GGUFReader anywhere) is the one the suite's
    references were made with."""
    from gguf import GGUFReader

    from pdserve.common.tokenizer import Tokenizer
    from pdserve.engine.model.gguf_config import gguf_header, model_config_from_gguf, read_model_config

    path = smollm[0].path
    reader = GGUFReader(str(path))
    meta = gguf_header(path)
    assert meta == _reader_metadata(reader)
    assert meta["tokenizer.ggml.tokens.count"] == 49152
    assert gguf_header(path, vocab=True) == _reader_metadata(reader, vocab=True)
    cfg = read_model_config(path)
    assert cfg == model_config_from_gguf(meta) and cfg.num_hidden_layers == 30 and cfg.vocab_size == 49152
    _same_tensors_as_the_reader(path, reader)
    built = Tokenizer._build_from_gguf(path)
    assert built._tok.to_str() == smollm[1]._tok.to_str()
    assert (built.eos_token_id, built.bos_token_id, built.chat_template) == (
        smollm[1].eos_token_id, smollm[1].bos_token_id, smollm[1].chat_template)


def test_the_header_reader_names_a_file_that_is_not_gguf(tmp_path):
    from pdserve.engine.model.gguf_config import gguf_header

    cfg = tiny_config()
    good = tmp_path / "tiny.gguf"
    write_gguf(good, cfg, tiny_state_dict(cfg, seed=1))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[:200])  # the metadata ends mid-value
    (tmp_path / "empty.gguf").write_bytes(b"")
    (tmp_path / "text.gguf").write_text("not a model at all")
    for name, why in [("cut.gguf", "ends early"), ("empty.gguf", "not a GGUF file"), ("text.gguf", "no GGUF magic")]:
        with pytest.raises(ModelLoadError, match=why):
            gguf_header(tmp_path / name)
