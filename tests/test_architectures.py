"""The Llama family's relatives against transformers' own implementations: for each
architecture a small random model (built by transformers from its config, seeded, saved as a
Hugging Face directory) gives the same logits within float tolerance and the same greedy
tokens in pdserve, batched as alone, with a prefix-cache hit as without; written as a GGUF
file in llama.cpp's layout (which transformers' GGUF loader reads back to the same model),
it loads in pdserve to the same logits."""
import pytest
import torch

from pdserve.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.engine.core.engine import LLMEngine
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.model.weights import load_model
from tests.helpers.reference import engine_logits

gguf = pytest.importorskip("gguf")

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0,
             tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
ARCHS = {  # name: (config class, model class, config fields of its own)
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    # every layer attends to its last 8 tokens only: the prompts and outputs below are longer
    "mistral-window": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 8}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"use_sliding_window": False}),
    # layers 1 and 2 slide (from max_window_layers on), layer 0 sees everything
    "qwen2-window": ("Qwen2Config", "Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 8,
                                                           "max_window_layers": 1}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32, "tie_word_embeddings": True}),
    # two sliding layers (RoPE base 10k) then a global one (1M); scores scaled by 24^-1/2, not 32^-1/2
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "head_dim": 32, "tie_word_embeddings": True, "sliding_window": 8, "query_pre_attn_scalar": 24,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]}),
}
WINDOWS = {"mistral-window": (8, 8, 8), "qwen2-window": (0, 8, 8), "gemma3": (8, 8, 0)}  # each layer's window
PROMPTS = [[5, 17, 99, 250, 3, 42, 42, 7], [300, 12, 8], list(range(20, 60))]


def hf_model(arch: str, seed: int = 0, **fields):
    """transformers' model of `arch`, its weights redrawn so that logits are peaked (greedy far
    from ties): matrices ~ N(0, 1/fan_in), norms 1 + N(0, 0.1^2), biases N(0, 0.1^2)."""
    conf_cls, model_cls, own = ARCHS[arch]
    cfg = getattr(transformers, conf_cls)(**(SMALL | own | fields))
    model = getattr(transformers, model_cls)(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (0.5 if "embed" in name else p.shape[-1] ** -0.5))
    return model


def saved(arch: str, tmp_path_factory):
    path = tmp_path_factory.mktemp(arch)
    hf = hf_model(arch)
    hf.save_pretrained(path)
    return hf, path


@pytest.fixture(scope="module", params=list(ARCHS))
def pair(request, tmp_path_factory):
    """(transformers' model, a pdserve engine on the same weights loaded from its directory)."""
    hf, path = saved(request.param, tmp_path_factory)
    loaded = load_model(path, quantization="none")
    assert loaded.config.model_type == request.param.split("-")[0]
    eng = LLMEngine(loaded, EngineConfig(quantization="none", cache=CacheConfig(kv_cache_memory=16 << 20)))
    eng.arch = request.param
    yield hf, eng
    assert eng.blocks.num_used_blocks == 0


def test_config_carries_what_sets_each_architecture_apart(pair):
    hf, eng = pair
    cfg = eng.loaded.config
    assert cfg.qkv_bias == (cfg.model_type == "qwen2") and cfg.qk_norm == (cfg.model_type in ("qwen3", "gemma3"))
    windows = tuple(cfg.window_of(i) for i in range(cfg.num_hidden_layers))
    assert windows == WINDOWS.get(eng.arch, (0, 0, 0))
    assert [layer.self_attn.window for layer in eng.runner.model.model.layers] == list(windows)
    head_dim = getattr(hf.config, "head_dim", None) or hf.config.hidden_size // hf.config.num_attention_heads
    assert cfg.tie_word_embeddings == hf.config.tie_word_embeddings and cfg.head_dim == head_dim


def test_logits_match_transformers(pair):
    hf, eng = pair
    for ids in PROMPTS:
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0]
        got = engine_logits(eng, ids)
        torch.testing.assert_close(got, want, atol=2e-4 * want.abs().max().item(), rtol=1e-4)


def test_greedy_tokens_match_transformers_batched_and_alone(pair):
    hf, eng = pair
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = []
    for ids in PROMPTS:
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, min_new_tokens=12,
                              pad_token_id=0)
        want.append(out[0, len(ids):].tolist())
    assert [eng.generate([ids], params)[0] for ids in PROMPTS] == want  # alone
    assert eng.generate(PROMPTS, params) == want                        # batched


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_a_bfloat16_model_runs_in_bfloat16_and_answers_as_in_fp32(arch, tmp_path_factory):
    """`dtype=bfloat16` on the CPU: every layer stays in bf16 (RoPE's fp32 tables are cast to
    it, as transformers does: fp32 q/k once met a bf16 o_proj and the step failed), logits
    within bf16's rounding of the fp32 model's, the same greedy tokens on these peaked weights."""
    _, path = saved(arch, tmp_path_factory)
    fp32 = LLMEngine(load_model(path, quantization="none"), EngineConfig(quantization="none"))
    bf16 = LLMEngine(load_model(path, dtype=torch.bfloat16, quantization="none"),
                     EngineConfig(dtype="bfloat16", quantization="none"))
    want, got = engine_logits(fp32, PROMPTS[2]), engine_logits(bf16, PROMPTS[2])
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=0.05 * want.abs().max().item(), rtol=0.05)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert bf16.generate(PROMPTS[:2], params) == fp32.generate(PROMPTS[:2], params)
    assert bf16.blocks.num_used_blocks == 0 and fp32.blocks.num_used_blocks == 0


def test_prefix_hit_equals_miss(pair):
    _, eng = pair
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = list(range(100, 150))  # three full blocks of 16, then more
    miss = eng.generate([prompt], params)[0]
    hits = eng.blocks.prefix_hits
    assert eng.generate([prompt], params)[0] == miss and eng.blocks.prefix_hits > hits


@pytest.mark.parametrize("arch", list(WINDOWS))
@pytest.mark.parametrize("attention,kv", [("torch", "auto"), ("native", "int8")])
def test_sliding_windows_on_the_other_attention_paths(arch, attention, kv, tmp_path_factory):
    """The torch reference path against transformers; and over an int8 cache (its prefill
    rows attend over a decoded copy of their blocks) a row's window is the same batched,
    alone, chunked and after a prefix hit."""
    hf, path = saved(arch, tmp_path_factory)
    eng = LLMEngine(load_model(path, quantization="none"), EngineConfig(
        quantization="none", attention=attention, scheduler=SchedulerConfig(max_num_batched_tokens=32),
        cache=CacheConfig(kv_cache_memory=16 << 20, kv_cache_dtype=kv)))
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    if kv == "auto":
        with torch.no_grad():
            want = hf(torch.tensor([PROMPTS[2]])).logits[0]
        torch.testing.assert_close(engine_logits(eng, PROMPTS[2]), want, atol=2e-4 * want.abs().max().item(),
                                   rtol=1e-4)
    alone = [eng.generate([ids], params)[0] for ids in PROMPTS]  # the 40-token prompt: chunked by 32
    assert eng.generate(PROMPTS, params) == alone
    assert eng.generate([PROMPTS[2]], params)[0] == alone[2]  # its full blocks now cached
    assert eng.blocks.num_used_blocks == 0


def test_configs_without_what_pdserve_runs_are_refused():
    # Qwen2 configs carry a window they do not use unless use_sliding_window is set
    assert ModelConfig.from_hf_dict(dict(SMALL, model_type="qwen2", sliding_window=64)).sliding_window == 0
    for bad in ({"model_type": "gpt2"}, {"model_type": "llama", "attention_bias": True},
                {"model_type": "qwen3", "mlp_bias": True}):
        with pytest.raises(ValueError, match="unsupported"):
            ModelConfig.from_hf_dict(dict(SMALL, **bad))
    with pytest.raises(ValueError, match="layer_types"):
        ModelConfig.from_hf_dict(dict(SMALL, model_type="mistral", sliding_window=8, layer_types=["sliding_attention"]))

_GGUF_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
               "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_GGUF_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}


def write_gguf(hf, arch: str, path) -> None:
    """`hf` as an fp32 GGUF file in llama.cpp's names and layout (Qwen: Q/K rows as Hugging
    Face has them, rotate-half RoPE)."""
    c = hf.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(SMALL["rope_theta"])
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        parts = name.split(".")
        out = _GGUF_TOP.get(name) or f"blk.{parts[2]}.{_GGUF_LAYER['.'.join(parts[3:-1])]}.{parts[-1]}"
        w.add_tensor(out, t.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_gguf_files_load_as_transformers_reads_them(arch, tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    hf = hf_model(arch)
    if arch == "qwen3":  # transformers' GGUF loader ignores key_length: Qwen3's default head_dim
        hf = hf_model(arch, head_dim=128)
    write_gguf(hf, arch, tmp_path / "model.gguf")
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        want = hf(ids).logits[0]
        theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="model.gguf").eval()
        torch.testing.assert_close(theirs(ids).logits[0], want)  # the file is what llama.cpp would write
    loaded = load_model(tmp_path / "model.gguf", quantization="none")
    assert (loaded.config.model_type, loaded.config.qkv_bias, loaded.config.qk_norm) == (
        arch, arch == "qwen2", arch == "qwen3")
    eng = LLMEngine(loaded, EngineConfig(quantization="none", cache=CacheConfig(kv_cache_memory=8 << 20)))
    got = engine_logits(eng, PROMPTS[2])
    torch.testing.assert_close(got, want, atol=2e-4 * want.abs().max().item(), rtol=1e-4)
