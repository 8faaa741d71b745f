"""Mixture-of-experts models (engine/model/moe.py) against transformers' own Mixtral,
Qwen3-MoE and OLMoE classes: small random models saved as Hugging Face directories give the
same logits within fp32 tolerance and the same greedy tokens, alone, batched and under
preemption; written as GGUF files in llama.cpp's layout (3-D `ffn_*_exps` tensors) they load
to the same logits. The router and the grouping of tokens by expert are checked on their
own: the grouped computation equals every expert over every row, masked, and a router that
sends every token to one expert works."""
import json

import pytest
import torch

from pdserve.common.errors import ModelLoadError
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.config import CacheConfig, EngineConfig, ModelConfig
from pdserve.engine.core.engine import LLMEngine
from pdserve.engine.model.moe import SparseMoeBlock, group_by_expert, reference_moe, route
from pdserve.engine.model.weights import load_model
from pdserve.engine.parallel.shard import check_degree
from tests.helpers.reference import engine_logits

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

SMALL = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 48, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
         "rope_theta": 10000.0, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
         "num_experts_per_tok": 2}
ARCHS = {  # name: (config class, model class, config fields of its own)
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 6, "sliding_window": None}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"num_experts": 8, "moe_intermediate_size": 32,
                                                            "norm_topk_prob": True, "head_dim": 32}),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {"num_experts": 4, "norm_topk_prob": False}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {"num_experts": 4, "moe_intermediate_size": 32,
                                                            "shared_expert_intermediate_size": 40}),
}
NORM_TOPK = {"mixtral": True, "qwen3_moe": True, "olmoe": False, "qwen2_moe": False}
EXPERT_WIDTH = {"mixtral": 48, "qwen3_moe": 32, "olmoe": 48, "qwen2_moe": 32}
PROMPTS = [[5, 17, 99, 250, 3, 42, 42, 7], [300, 12, 8], list(range(20, 60))]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def hf_model(arch: str, seed: int = 0, **fields):
    """transformers' model of `arch` with peaked random weights (greedy far from ties):
    matrices ~ N(0, 1/fan_in), norms 1 + N(0, 0.1^2); routers N(0, 1) so routing is decided."""
    conf_cls, model_cls, own = ARCHS[arch]
    model = getattr(transformers, model_cls)(getattr(transformers, conf_cls)(**(SMALL | own | fields))).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                scale = 0.5 if "embed" in name else 1.0 if name.endswith("mlp.gate.weight") else p.shape[-1] ** -0.5
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    return model


def hf_greedy(hf, prompts: list[list[int]], n: int = 10) -> list[list[int]]:
    out = []
    for ids in prompts:
        with torch.no_grad():
            seq = hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        out.append(seq[0, len(ids):].tolist())
    return out


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, atol=2e-4 * want.abs().max().item(), rtol=1e-4)


@pytest.fixture(scope="module", params=list(ARCHS))
def pair(request, tmp_path_factory):
    """(transformers' model, its directory, a pdserve engine loaded from the directory)."""
    path = tmp_path_factory.mktemp(request.param)
    hf = hf_model(request.param)
    hf.save_pretrained(path)
    eng = LLMEngine(load_model(path, quantization="none"),
                    EngineConfig(quantization="none", cache=CacheConfig(kv_cache_memory=8 << 20)))
    yield hf, path, eng
    assert eng.blocks.num_used_blocks == 0


def test_config_reads_the_experts(pair):
    hf, _, eng = pair
    cfg, c = eng.loaded.config, hf.config
    assert cfg.num_experts == (getattr(c, "num_local_experts", None) or c.num_experts)
    assert (cfg.num_experts_per_tok, cfg.norm_topk_prob) == (2, NORM_TOPK[cfg.model_type])
    assert cfg.moe_intermediate_size == EXPERT_WIDTH[cfg.model_type]
    assert cfg.shared_expert_intermediate_size == (40 if cfg.model_type == "qwen2_moe" else 0)
    assert cfg.qkv_bias == (cfg.model_type == "qwen2_moe")
    model = eng.runner.model
    assert model.native_decode is None  # the one-call C step is for dense models
    assert all(b.native == model.native_ops for b in model.moe_blocks()) and len(model.moe_blocks()) == 2


def test_logits_and_greedy_tokens_match_transformers(pair):
    hf, _, eng = pair
    for ids in PROMPTS:
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0]
        close(engine_logits(eng, ids), want)
    want = hf_greedy(hf, PROMPTS)
    assert [eng.generate([ids], GREEDY)[0] for ids in PROMPTS] == want  # alone
    assert eng.generate(PROMPTS, GREEDY) == want                        # batched


def test_batched_under_preemption_equals_alone(pair):
    _, path, eng = pair
    prompts = [[(7 * i + j) % 300 + 3 for j in range(20 + 3 * i)] for i in range(6)]
    want = eng.generate(prompts, GREEDY)
    # 8 blocks of 16 tokens cannot hold 6 sequences of 30-45 tokens: preemption must happen
    tight = LLMEngine(load_model(path, quantization="none"), EngineConfig(
        quantization="none", cache=CacheConfig(kv_cache_memory=8 * eng.kv_cache.bytes_per_block, kv_host_memory=0)))
    preempted = []
    orig = tight.scheduler._preempt
    tight.scheduler._preempt = lambda r, cause: (preempted.append(r.request_id), orig(r, cause))
    assert tight.generate(prompts, GREEDY) == want and preempted
    assert tight.blocks.num_used_blocks == 0


def test_quantized_experts_run_on_the_quantized_kernels(pair):
    """int8 weights per expert matrix (engine/model/quant.py): every expert's matrices are
    quantized, the logits stay near fp32's (on average: int8 may flip a near-tie of the router)."""
    hf, path, _ = pair
    loaded = load_model(path, quantization="int8")
    n_moe = loaded.model.config.num_hidden_layers
    assert loaded.model.quantized_matrices() >= n_moe * 2 * loaded.config.num_experts
    eng = LLMEngine(loaded, EngineConfig(quantization="int8", cache=CacheConfig(kv_cache_memory=4 << 20)))
    with torch.no_grad():
        want = hf(torch.tensor([PROMPTS[2]])).logits[0]
    got = engine_logits(eng, PROMPTS[2])
    assert (got - want).abs().mean() < 0.03 * want.abs().mean()


def test_route_keeps_the_top_k_and_renormalizes_as_asked():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 3.0, 0.0, 0.0]])
    w, e = route(logits, 2, renormalize=False)
    probs = torch.softmax(logits, -1)
    assert e[0].tolist() == [1, 2] and torch.allclose(w[0], probs[0, [1, 2]])
    w, e = route(logits, 2, renormalize=True)
    assert torch.allclose(w.sum(-1), torch.ones(2)) and sorted(e[1].tolist()) == [0, 1]


def test_grouping_by_expert_is_exact_and_skips_experts_not_owned():
    experts = torch.tensor([[2, 0], [0, 3], [2, 3]])
    weights = torch.tensor([[0.625, 0.375], [0.75, 0.25], [0.5, 0.5]])
    groups = group_by_expert(experts, weights, 4)
    assert [(g.expert, g.rows.tolist(), g.weights.tolist()) for g in groups] == [
        (0, [0, 1], [0.375, 0.75]), (2, [0, 2], [0.625, 0.5]), (3, [1, 2], [0.25, 0.5])]
    assert [g.expert for g in group_by_expert(experts, weights, 4, owned=range(2, 4))] == [2, 3]


@pytest.mark.parametrize("skewed", [False, True])
def test_grouped_experts_equal_the_dense_definition(skewed):
    """Every token through its chosen experts only equals every expert over every row, masked;
    a router biased so that every token picks the same two experts works the same."""
    cfg = ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, model_type="mixtral", num_experts=6, num_experts_per_tok=2)
    torch.manual_seed(0)
    block = SparseMoeBlock(cfg)
    x = torch.randn(37, 32)
    if skewed:
        with torch.no_grad():
            x[:, 0] = 5.0
            block.gate.weight.zero_()
            block.gate.weight[4, 0] = 100.0  # expert 4 first for every row, the others tied
    _, experts = route(block.gate(x), 2, True)
    if skewed:
        assert (experts[:, 0] == 4).all()
    with torch.no_grad():
        want = reference_moe(x, block)
        torch.testing.assert_close(block(x), want, atol=1e-5, rtol=1e-5)
        block.fuse(packed=True)
        torch.testing.assert_close(block(x), want, atol=1e-5, rtol=1e-5)


def test_moe_configs_refused_where_pdserve_does_not_run_them():
    d = dict(SMALL, model_type="olmoe", num_experts=4)
    assert ModelConfig.from_hf_dict(d).num_experts == 4
    with pytest.raises(ValueError, match="clip_qkv"):
        ModelConfig.from_hf_dict(d | {"clip_qkv": 8.0})
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig.from_hf_dict(d | {"num_experts_per_tok": 5})
    q = ModelConfig.from_hf_dict(dict(SMALL, model_type="qwen3_moe", num_experts=4, num_hidden_layers=4,
                                      mlp_only_layers=[0], decoder_sparse_step=2))
    assert q.dense_layers == (0, 2)  # listed, or off the sparse step (layers 1 and 3 are sparse)
    with pytest.raises(ValueError, match="mixture-of-experts"):
        check_degree(q, 2)


def permute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's Q/K row permutation for its interleaved RoPE (Llama-architecture files)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


Q4_1 = gguf.GGMLQuantizationType.Q4_1
_GGUF_ARCH = {"mixtral": "llama", "qwen3_moe": "qwen3moe", "olmoe": "olmoe", "qwen2_moe": "qwen2moe"}
_GGUF_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate": "ffn_gate_inp",
               "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
               "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
_GGUF_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}


def gguf_tensors(hf, arch: str) -> dict[str, torch.Tensor]:
    """`hf`'s weights under llama.cpp's names: each layer's experts as 3-D ffn_{gate,up,down}_exps
    (one slice per expert), the router as ffn_gate_inp; Q/K permuted in Llama-architecture files."""
    c, out = hf.config, {}
    for name, t in hf.state_dict().items():
        parts = name.split(".")
        if name in _GGUF_TOP:
            out[_GGUF_TOP[name]] = t
            continue
        blk, sub = f"blk.{parts[2]}", ".".join(parts[3:-1])
        if name.endswith("experts.gate_up_proj"):  # transformers' fused (E, 2I, H)
            out[f"{blk}.ffn_gate_exps.weight"], out[f"{blk}.ffn_up_exps.weight"] = t.chunk(2, dim=1)
        elif name.endswith("experts.down_proj"):
            out[f"{blk}.ffn_down_exps.weight"] = t
        else:
            if arch == "mixtral" and sub in ("self_attn.q_proj", "self_attn.k_proj"):
                t = permute_qk(t, c.num_attention_heads if "q_proj" in sub else c.num_key_value_heads)
            out[f"{blk}.{_GGUF_LAYER[sub]}.{parts[-1]}"] = t
    return out


def write_gguf(hf, arch: str, path, drop: str = "", short: str = "", q4_1: bool = False) -> None:
    """`hf` as an fp32 GGUF in llama.cpp's layout; `drop`: a tensor left out; `short`: a tensor
    written with one expert too few; `q4_1`: the experts in Q4_1."""
    c, w = hf.config, gguf.GGUFWriter(str(path), _GGUF_ARCH[arch])
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    for add, value in ((w.add_context_length, c.max_position_embeddings), (w.add_embedding_length, c.hidden_size),
                       (w.add_block_count, c.num_hidden_layers), (w.add_feed_forward_length, c.intermediate_size),
                       (w.add_head_count, c.num_attention_heads), (w.add_head_count_kv, c.num_key_value_heads),
                       (w.add_layer_norm_rms_eps, c.rms_norm_eps), (w.add_rope_freq_base, SMALL["rope_theta"]),
                       (w.add_key_length, hd), (w.add_value_length, hd),
                       (w.add_expert_count, getattr(c, "num_local_experts", None) or c.num_experts),
                       (w.add_expert_used_count, c.num_experts_per_tok), (w.add_bos_token_id, 1),
                       (w.add_eos_token_id, 2)):
        add(value)
    if arch in ("qwen2_moe", "qwen3_moe"):
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    if arch == "qwen2_moe":
        w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    for name, t in gguf_tensors(hf, arch).items():
        a = (t[:-1] if name == short else t).float().contiguous().numpy()
        if q4_1 and "_exps" in name:
            w.add_tensor(name, gguf.quants.quantize(a, Q4_1), raw_dtype=Q4_1)
        elif name != drop:
            w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", list(ARCHS))
def test_gguf_files_load_to_the_same_logits(arch, tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    hf = hf_model(arch)
    write_gguf(hf, arch, tmp_path / "model.gguf")
    for _ in range(2):  # converted, then from the conversion cache
        loaded = load_model(tmp_path / "model.gguf", quantization="none")
        assert (loaded.config.model_type, loaded.config.num_experts_per_tok, loaded.config.norm_topk_prob) == (
            arch, 2, NORM_TOPK[arch])
    eng = LLMEngine(loaded, EngineConfig(quantization="none", cache=CacheConfig(kv_cache_memory=4 << 20)))
    with torch.no_grad():
        want = hf(torch.tensor([PROMPTS[2]])).logits[0]
    close(engine_logits(eng, PROMPTS[2]), want)
    assert eng.generate([PROMPTS[0]], GREEDY)[0] == hf_greedy(hf, [PROMPTS[0]])[0]


def test_a_gguf_missing_experts_is_refused_by_name(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    hf = hf_model("mixtral")
    write_gguf(hf, "mixtral", tmp_path / "short.gguf", short="blk.1.ffn_up_exps.weight")
    with pytest.raises(ModelLoadError, match=r"blk\.1\.ffn_up_exps\.weight.*one slice per expert \(6"):
        load_model(tmp_path / "short.gguf", quantization="none")
    write_gguf(hf, "mixtral", tmp_path / "dropped.gguf", drop="blk.0.ffn_down_exps.weight")
    with pytest.raises(ModelLoadError, match=r"missing tensor 'model\.layers\.0\.mlp\.experts\.0\.down_proj"):
        load_model(tmp_path / "dropped.gguf", quantization="none")


def test_q4_1_experts_run_on_the_4_bit_kernels(tmp_path, monkeypatch):
    """A GGUF whose experts are Q4_1 (as quantized MoE files ship): "exact" runs each expert on
    the checkpoint's own values (the fp32 model's logits), "auto" on W4A8 (int8 activations)."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    write_gguf(hf_model("qwen3_moe"), "qwen3_moe", tmp_path / "q.gguf", q4_1=True)
    logits, experts = {}, 2 * 2 * 8  # layers x (gate_up, down) x experts
    for mode in ("none", "exact", "auto"):
        loaded = load_model(tmp_path / "q.gguf", quantization=mode)
        assert loaded.model.quantized_matrices() == (0 if mode == "none" else experts)
        eng = LLMEngine(loaded, EngineConfig(quantization=mode, cache=CacheConfig(kv_cache_memory=4 << 20)))
        logits[mode] = engine_logits(eng, PROMPTS[2])
    close(logits["exact"], logits["none"])
    assert (logits["auto"] - logits["none"]).abs().mean() < 0.03 * logits["none"].abs().mean()


@pytest.mark.parametrize("arch", list(ARCHS))
def test_weights_from_a_gguf_export_as_a_directory_transformers_loads(arch, tmp_path, monkeypatch):
    """What `pdserve export-hf` writes (checkpoint_names, to_hf_dict), minus the tokenizer."""
    from safetensors.torch import save_file

    from pdserve.engine.model.moe_weights import checkpoint_names
    from pdserve.engine.model.weights import load_state_dict
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    hf = hf_model(arch)
    write_gguf(hf, arch, tmp_path / "m.gguf")
    state, cfg, _ = load_state_dict(tmp_path / "m.gguf")
    out = tmp_path / "hf"
    out.mkdir()
    save_file({k: v.contiguous() for k, v in checkpoint_names(state, cfg).items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        close(theirs(ids).logits[0], hf(ids).logits[0])


def test_lora_adapters_on_expert_layers_are_refused():
    from safetensors.torch import save

    from pdserve.engine.model.lora import LoRAUnsupportedError, read_tensors
    cfg = ModelConfig.from_hf_dict(dict(SMALL, model_type="qwen3_moe", num_experts=4, moe_intermediate_size=32))
    key = "base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight"
    with pytest.raises(LoRAUnsupportedError, match="mixture-of-experts"):
        read_tensors(save({key: torch.zeros(4, 64)}), "ad", cfg, 4)


def test_dense_layers_between_expert_layers(tmp_path):
    """Qwen3-MoE with mlp_only_layers: layer 0 a dense MLP of intermediate_size, layer 1 experts."""
    hf = hf_model("qwen3_moe", mlp_only_layers=[0])
    hf.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, quantization="none")
    assert loaded.config.dense_layers == (0,) and len(loaded.model.moe_blocks()) == 1
    eng = LLMEngine(loaded, EngineConfig(quantization="none", cache=CacheConfig(kv_cache_memory=4 << 20)))
    with torch.no_grad():
        want = hf(torch.tensor([PROMPTS[2]])).logits[0]
    close(engine_logits(eng, PROMPTS[2]), want)
    assert eng.generate([PROMPTS[0]], GREEDY)[0] == hf_greedy(hf, [PROMPTS[0]])[0]


def test_fused_expert_tensors_as_transformers_holds_them(tmp_path):
    """A directory with transformers' in-memory layout (3-D experts.gate_up_proj / down_proj)."""
    from safetensors.torch import save_file
    hf = hf_model("olmoe")
    state = hf.state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    hf.config.to_json_file(str(tmp_path / "config.json"))
    eng = LLMEngine(load_model(tmp_path, quantization="none"),
                    EngineConfig(quantization="none", cache=CacheConfig(kv_cache_memory=4 << 20)))
    with torch.no_grad():
        close(engine_logits(eng, PROMPTS[2]), hf(torch.tensor([PROMPTS[2]])).logits[0])


def test_incomplete_gguf_expert_metadata_is_refused():
    from pdserve.engine.model.gguf_config import gguf_moe_fields
    assert gguf_moe_fields({"llama.feed_forward_length": 96}, "llama") == {}  # a dense Llama
    with pytest.raises(ModelLoadError, match="expert_used_count"):
        gguf_moe_fields({"llama.expert_count": 8}, "llama")
    with pytest.raises(ModelLoadError, match="'qwen2' with experts"):
        gguf_moe_fields({"qwen2.expert_count": 8, "qwen2.expert_used_count": 2}, "qwen2")
    fields = gguf_moe_fields({"llama.expert_count": 8, "llama.expert_used_count": 2, "llama.feed_forward_length": 96,
                              "llama.expert_weights_norm": False}, "llama")
    assert (fields["model_type"], fields["moe_intermediate_size"], fields["norm_topk_prob"]) == ("mixtral", 96, False)


def test_a_long_prompt_step_pauses_within_its_layers_after_each_experts_rows(pair):
    """A step of more than PAUSE_MIN_TOKENS prompt tokens offers the pause for a peer's urgent
    step inside each layer, not only at its end: an MoE layer after its attention and after
    each expert's rows (its MLP is many small matmuls); the tokens are those without it."""
    from pdserve.engine.core.urgency import PAUSE_MIN_TOKENS
    _, path, eng = pair
    prompt = [(11 * j) % 300 + 3 for j in range(PAUSE_MIN_TOKENS + 20)]
    want = eng.generate([prompt], GREEDY)
    paused = LLMEngine(load_model(path, quantization="none"),
                       EngineConfig(quantization="none", cache=CacheConfig(kv_cache_memory=8 << 20)))
    calls = []
    paused.between_layers = calls.append
    assert paused.generate([prompt], GREEDY) == want
    layers, experts = eng.model_config.num_hidden_layers, eng.model_config.num_experts_per_tok
    # per layer: after the attention, after each of at least top-k experts' rows, at the end
    assert len(calls) >= layers * (2 + experts)
    assert paused.blocks.num_used_blocks == 0
