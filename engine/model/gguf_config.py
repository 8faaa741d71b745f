"""A model's config from its GGUF header or Hugging Face `config.json`, without torch and
without the weights: what `pdserve up` needs to refuse a parallel degree the model cannot be
split into before anything starts (the loader, engine/model/weights.py, builds the same
config from the same metadata).

`gguf_header` (common/gguf_file.py) reads only the key-value metadata at the file's start:
~20 ms for the default model."""
from __future__ import annotations

import json
from pathlib import Path

from pdserve.common.errors import ModelLoadError
from pdserve.common.gguf_file import gguf_header  # noqa: F401 - the header's reader, for this module's callers
from pdserve.engine.config import ModelConfig

# general.architecture values (Mistral, and Mixtral with expert_count set, ship as llama)
GGUF_ARCHS = ("llama", "qwen2", "qwen3", "gemma3", "qwen2moe", "qwen3moe", "olmoe")
GEMMA3_GLOBAL_EVERY = 6  # Gemma 3: layers 5, 11, ... attend globally, the rest slide (llama.cpp's rule too)
GEMMA3_LOCAL_ROPE_THETA = 10000.0  # its sliding layers' RoPE base (not in its GGUF metadata)
# llama.cpp renormalizes the top-k weights for these architectures (its build_moe_ffn's norm_w),
# unless the file says otherwise in {arch}.expert_weights_norm
_GGUF_NORM_TOPK = {"llama": True, "qwen2moe": False, "qwen3moe": True, "olmoe": False}
GGUF_MOE_TYPES = {"llama": "mixtral", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "olmoe": "olmoe"}


def model_config_from_gguf(meta: dict) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHS:
        raise ModelLoadError(f"unsupported GGUF architecture {arch!r}: pdserve runs {', '.join(GGUF_ARCHS)}")

    def get(key, default=None):
        v = meta.get(f"{arch}.{key}", default)
        if v is None:
            raise ModelLoadError(f"GGUF metadata key {arch}.{key} is missing")
        return v

    n_heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    return ModelConfig(
        vocab_size=int(meta.get(f"{arch}.vocab_size") or meta.get("tokenizer.ggml.tokens.count")
                       or len(meta.get("tokenizer.ggml.tokens") or ())),
        hidden_size=hidden, intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=int(get("block_count")), num_attention_heads=n_heads,
        num_key_value_heads=int(get("attention.head_count_kv", n_heads)),
        head_dim=int(meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count")
                     or hidden // n_heads),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings=False,  # decided by the presence of output.weight
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        qkv_bias=arch in ("qwen2", "qwen2moe"), sliding_window=int(meta.get(f"{arch}.attention.sliding_window") or 0),
        **_gguf_gemma3(meta, arch),
        **({"model_type": arch, "qk_norm": arch in ("qwen3", "gemma3")} | gguf_moe_fields(meta, arch)))


def _gguf_gemma3(meta: dict, arch: str) -> dict:
    """What a Gemma 3 GGUF leaves to the reader: which layers slide, their RoPE base, GELU."""
    if arch != "gemma3":
        return {}
    n = int(meta["gemma3.block_count"])
    return {"hidden_activation": "gelu_pytorch_tanh", "rope_local_theta": GEMMA3_LOCAL_ROPE_THETA,
            "layer_types": tuple("full_attention" if (i + 1) % GEMMA3_GLOBAL_EVERY == 0 else "sliding_attention"
                                 for i in range(n))}


def gguf_moe_fields(meta: dict, arch: str) -> dict:
    """The ModelConfig fields of an MoE GGUF (empty for a dense one): the model type, the
    expert counts and width, and whether the top-k weights are renormalized."""
    count = int(meta.get(f"{arch}.expert_count") or 0)
    if not count:
        return {}
    if arch not in GGUF_MOE_TYPES:
        raise ModelLoadError(f"GGUF architecture {arch!r} with experts is not supported: pdserve runs the "
                             f"experts of {', '.join(GGUF_MOE_TYPES)}")
    used = meta.get(f"{arch}.expert_used_count")
    if not used:
        raise ModelLoadError(f"GGUF metadata key {arch}.expert_used_count is missing")
    width = meta.get(f"{arch}.expert_feed_forward_length") or meta.get(f"{arch}.feed_forward_length")
    norm = meta.get(f"{arch}.expert_weights_norm", _GGUF_NORM_TOPK[arch])
    return {"model_type": GGUF_MOE_TYPES[arch], "num_experts": count, "num_experts_per_tok": int(used),
            "moe_intermediate_size": int(width), "norm_topk_prob": bool(norm),
            "shared_expert_intermediate_size": int(meta.get(f"{arch}.expert_shared_feed_forward_length") or 0),
            "qk_norm": arch in ("qwen3moe", "olmoe")}


def read_model_config(path: Path) -> ModelConfig:
    """The config of the model at `path` (a Hugging Face directory's config.json, a GGUF file's
    header), without reading its weights."""
    if path.is_dir():
        cfg_file = path / "config.json"
        if not cfg_file.exists():
            raise ModelLoadError(f"{path} has no config.json: not a Hugging Face model directory")
        return ModelConfig.from_hf_dict(json.loads(cfg_file.read_text()))
    return model_config_from_gguf(gguf_header(path))
