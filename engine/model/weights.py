"""Weight loading: GGUF files and Hugging Face directories into `LlamaForCausalLM` (Llama,
Mistral, Qwen2, Qwen3).

GGUF tensors are renamed to Hugging Face names, dequantized (gguf's numpy dequantizer handles
Q4_0, Q4_1, Q8_0, F16, F32 and the other ggml types), and the Q/K row permutation that
llama.cpp's converter applies for its RoPE layout is undone. A converted GGUF is cached as
safetensors (keyed by path, size and mtime) so the next start skips dequantization, and what
"auto" and "exact" derive from its grid matrices is cached beside it (engine/model/packed_cache.py).
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pdserve.engine.config import ModelConfig
from pdserve.common.errors import ModelLoadError
from pdserve.common.model_files import (  # noqa: F401 - the loader's callers find the default model here too
    DEFAULT_MODEL_FILE, DEFAULT_MODEL_PACKAGE, cache_dir, content_fingerprint, default_model_path, file_fingerprint,
    resolve_model_path)
from pdserve.engine.model import moe_weights, packed_cache
from pdserve.common.gguf_file import gguf_contents
from pdserve.engine.model.gguf_config import model_config_from_gguf, read_model_config
from pdserve.engine.model.llama import LlamaForCausalLM


_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_IGNORED_HF = re.compile(r".*rotary_emb\.inv_freq$")


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs -> HF's rotate-half)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# Gemma 3's four norms a layer: llama.cpp's ffn_norm is the one before the MLP there
_GGUF_GEMMA3_NAMES = _GGUF_LAYER_NAMES | {"post_attention_norm": "post_attention_layernorm",
                                          "ffn_norm": "pre_feedforward_layernorm",
                                          "post_ffw_norm": "post_feedforward_layernorm"}

# ggml types stored as plain numbers: their numpy dtype
_PLAIN_GGUF_TYPES = {"F32": "f4", "F16": "f2", "F64": "f8", "I8": "i1", "I16": "i2", "I32": "i4", "I64": "i8"}


def _gguf_to_hf_name(name: str, arch: str = "llama") -> str:
    if name in _GGUF_NAMES:
        return _GGUF_NAMES[name]
    names = _GGUF_GEMMA3_NAMES if arch == "gemma3" else _GGUF_LAYER_NAMES
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if not m or m.group(2) not in names:
        raise ModelLoadError(f"unexpected GGUF tensor {name!r} for a {arch} model")
    return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"


def _gguf_arrays(path: Path):
    """(metadata, [(tensor name, ggml type, its data as gguf's dequantizer takes it, its
    shape)]) of the GGUF file at `path`: views into one read-only map (plain numbers in this
    machine's byte order)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    meta, records, order = gguf_contents(path)
    data = np.memmap(path, mode="r")
    out = []
    for t in records:
        try:
            kind = GGMLQuantizationType(t.kind)
        except ValueError:
            raise ModelLoadError(f"tensor {t.name!r}: unknown GGUF type {t.kind}") from None
        block, size = GGML_QUANT_SIZES[kind]
        shape = tuple(reversed(t.dims))
        n_bytes = int(np.prod(t.dims, dtype=np.int64)) * size // block
        if t.offset + n_bytes > data.size:
            raise ModelLoadError(f"{path}: tensor {t.name!r} runs past the file's end (cut short?)")
        raw = data[t.offset:t.offset + n_bytes]
        if kind.name in _PLAIN_GGUF_TYPES:  # in this machine's byte order, as the dequantizer reads them
            dtype = np.dtype(_PLAIN_GGUF_TYPES[kind.name])
            arr = raw.view(dtype.newbyteorder(order)).astype(dtype, copy=False).reshape(shape)
        else:
            arr = raw.reshape(*shape[:-1], shape[-1] // block * size)
        out.append((t.name, kind, arr, shape))
    return meta, out


def read_gguf_state_dict(path: Path) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    """Dequantize every tensor of a GGUF file to fp32, with Hugging Face names."""
    from gguf.quants import dequantize

    meta, tensors = _gguf_arrays(path)
    cfg = model_config_from_gguf(meta)
    state = {}
    for t_name, t_kind, t_data, shape in tensors:
        moe = cfg.num_experts and moe_weights.is_expert_tensor(t_name)
        name = t_name if moe else _gguf_to_hf_name(t_name, cfg.model_type)
        try:
            arr = dequantize(t_data, t_kind)
        except NotImplementedError as e:
            raise ModelLoadError(f"tensor {t_name!r}: unsupported GGUF type {t_kind.name}") from e
        arr = np.asarray(arr, dtype=np.float32).reshape(shape)
        if moe:  # a layer's experts (one slice each) or its router
            state.update({k: torch.from_numpy(np.array(v, dtype=np.float32, order="C"))
                          for k, v in moe_weights.gguf_expert_tensors(t_name, arr, cfg.num_experts).items()})
            continue
        # llama.cpp permutes Q/K for its interleaved RoPE only in Llama files; Qwen's use the
        # rotate-half ("NEOX") layout, as Hugging Face does
        if cfg.model_type in ("llama", "mixtral") and name.endswith("q_proj.weight"):
            arr = unpermute_qk(arr, cfg.num_attention_heads)
        elif cfg.model_type in ("llama", "mixtral") and name.endswith("k_proj.weight"):
            arr = unpermute_qk(arr, cfg.num_key_value_heads)
        state[name] = torch.from_numpy(np.array(arr, dtype=np.float32, order="C"))
    tied = "lm_head.weight" not in state
    cfg = ModelConfig(**{**cfg.__dict__, "tie_word_embeddings": tied})
    return state, cfg


def read_hf_state_dict(path: Path) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    from safetensors.torch import load_file

    cfg = read_model_config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors weight files")
    state = {}
    for f in files:
        state.update(load_file(str(f)))
    if cfg.num_experts:  # Mixtral's names, transformers' fused experts: to moe.py's names
        state = moe_weights.hf_expert_names(state, cfg)
    if cfg.model_type == "gemma3":  # Gemma's norms multiply by (1 + w): store 1 + w (as GGUF files do)
        state = {k: v + 1.0 if k.endswith("norm.weight") else v for k, v in state.items()}
    return state, cfg


def load_state_dict(path: Path) -> tuple[dict[str, torch.Tensor], ModelConfig, str]:
    """Read weights (from the conversion cache when valid) and return them with the config
    and a fingerprint of the source."""
    from safetensors.torch import load_file, save_file

    if path.is_dir():
        state, cfg = read_hf_state_dict(path)
        return state, cfg, content_fingerprint(sorted(path.glob("*.safetensors")))
    if path.suffix != ".gguf":
        raise ModelLoadError(f"{path}: expected a .gguf file or a Hugging Face directory")
    fp = content_fingerprint([path])
    cached = cache_dir() / f"{path.stem}-{file_fingerprint(path)}.safetensors"
    if cached.exists():
        try:
            from safetensors import safe_open
            with safe_open(str(cached), "pt") as f:
                cfg = ModelConfig(**json.loads(f.metadata()["pdserve_config"]))
            return load_file(str(cached)), cfg, fp
        except Exception:  # a corrupt or foreign cache file: convert again
            pass
    state, cfg = read_gguf_state_dict(path)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".tmp{os.getpid()}")
        save_file(state, str(tmp), metadata={"pdserve_config": json.dumps(cfg.__dict__),
                                             "pdserve_source": str(path.resolve())})
        os.replace(tmp, cached)  # atomic: concurrent workers never read a half-written cache
        _prune_conversions(cached, path.resolve())
    except OSError:
        pass  # a read-only home still works, only slower on the next start
    return state, cfg, fp


def _prune_conversions(kept: Path, source: Path) -> None:
    """Remove the cached conversions no model file needs any more: those of an older version
    of `source` (`kept` is its current one) and those whose source file is gone; conversions
    that do not name their source are kept."""
    from safetensors import safe_open

    for f in kept.parent.glob("*.safetensors"):
        if f == kept:
            continue
        try:
            with safe_open(str(f), "pt") as h:
                other = (h.metadata() or {}).get("pdserve_source")
        except Exception:  # half-written or foreign: not ours to judge
            continue
        if other and (other == str(source) or not Path(other).exists()):
            f.unlink(missing_ok=True)


def load_weights_into(model: LlamaForCausalLM, state: dict[str, torch.Tensor],
                      dtype: torch.dtype = torch.float32) -> None:
    """Assign weights by name; a missing, unexpected or mis-shaped tensor fails with its name.
    Works on a model built on the meta device (no memory is spent on a throwaway init)."""
    tied = model.config.tie_word_embeddings
    expected = {k: v.shape for k, v in model.state_dict().items()}
    state = {k: v for k, v in state.items() if not _IGNORED_HF.match(k)}
    if tied:
        state.pop("lm_head.weight", None)  # some tied checkpoints still carry the copy
    for name in state:
        if name not in expected:
            raise ModelLoadError(f"unexpected tensor {name!r} in checkpoint (not part of this {model.config.model_type} model)")
    for name, shape in expected.items():
        if tied and name == "lm_head.weight":
            continue
        if name not in state:
            raise ModelLoadError(f"checkpoint is missing tensor {name!r}")
        if tuple(state[name].shape) != tuple(shape):
            raise ModelLoadError(
                f"tensor {name!r} has shape {tuple(state[name].shape)}, the config expects {tuple(shape)}")
    state = {k: v.to(dtype) for k, v in state.items()}
    if tied:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    path: Path
    fingerprint: str


def build_model(cfg: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
                device: str = "cpu", packed_weights: bool = True, quantization: str = "auto",
                experts=None, layers: range | None = None, forms=None) -> LlamaForCausalLM:
    """Instantiate the model for `cfg` with `state`'s weights, fused for inference. `experts`:
    an expert-parallel rank's share (moe.ExpertShare), whose experts alone `state` holds;
    `layers`: a pipeline stage's (engine/parallel/pp.py), numbered from 0 in `state`; `forms`:
    a dense model's grid forms, recorded or replayed (engine/model/packed_cache.py)."""
    cfg.check_runnable()
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    if layers is not None:  # each keeps its index in the whole model (per-layer windows)
        model.model.layers = model.model.layers[layers.start:layers.stop]
    if experts is not None:
        model.keep_experts(experts)
    load_weights_into(model, state, dtype)
    model.build_rotary()  # on the meta device until now
    fuse = {} if forms is None else {"forms": forms}
    return model.to(device).eval().fuse(packed_weights, quantization, **fuse)


def model_class(cfg: ModelConfig) -> type[LlamaForCausalLM]:
    """The module for `cfg`'s architecture (parameter names as Hugging Face's)."""
    if cfg.model_type == "gemma3":
        from pdserve.engine.model.gemma3 import Gemma3ForCausalLM
        return Gemma3ForCausalLM
    if cfg.num_experts:
        from pdserve.engine.model.moe import MoeForCausalLM
        return MoeForCausalLM
    return LlamaForCausalLM


def load_model(model: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32,
               device: str = "cpu", max_model_len: int = 0, packed_weights: bool = True,
               quantization: str = "auto") -> LoadedModel:
    """Load a GGUF file or a Hugging Face directory (default: SmolLM2-135M-Instruct).
    `max_model_len` (if > 0) overrides the model's context length. A quantized model gets its
    own fingerprint: its KV differs from the full-precision model's, so workers refuse to mix them
    ("auto"/"exact" only when they found matrices to run quantized, named by what they resolved
    to: "+w4a8" with int8 activations, "+exact" when only the kernels' sums differ)."""
    path = resolve_model_path(model)
    state, cfg, fingerprint = load_state_dict(path)
    if max_model_len:
        cfg = ModelConfig(**{**cfg.__dict__, "max_position_embeddings": max_model_len})
    built = build_cached(path, cfg, state, dtype, device, packed_weights, quantization)
    return LoadedModel(built, cfg, path, quantized_fingerprint(fingerprint, quantization, built))


def build_cached(path: Path, cfg: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype, device: str,
                 packed_weights: bool, quantization: str, part: str = "", **kw) -> LlamaForCausalLM:
    """build_model, its grid forms replayed from the cache when a previous load of the same
    weights, quantization, code and `part` (a tensor-parallel rank's slice or a pipeline stage,
    named by the caller) left them there, else computed and recorded there. Only a dense fp32
    model on the CPU under "auto" or "exact", read from a GGUF file, has them; a cache that does not
    fit (packed_cache.StaleForms) is set aside and the model built again. `kw`: build_model's."""
    if quantization not in ("auto", "exact") or device != "cpu" or dtype != torch.float32 or cfg.num_experts \
            or kw.get("experts") is not None or not path.is_file() or path.suffix != ".gguf":
        return build_model(cfg, state, dtype, device, packed_weights, quantization, **kw)
    file = packed_cache.cache_path(path, quantization, part)
    forms = packed_cache.load(file)
    if forms is not None:
        try:
            built = build_model(cfg, state, dtype, device, packed_weights, quantization, forms=forms, **kw)
            if forms.complete():
                return built
        except packed_cache.StaleForms:
            pass
    forms = packed_cache.PackedForms()
    built = build_model(cfg, state, dtype, device, packed_weights, quantization, forms=forms, **kw)
    packed_cache.save(forms, file, path)
    return built


def quantized_fingerprint(fingerprint: str, quantization: str, built: LlamaForCausalLM) -> str:
    """The fingerprint of the weights' KV as `built` computes it: a quantized model's differs
    from the full-precision one's. A tensor-parallel slice gets its whole model's (its KV
    leaves the group in the whole model's layout, equal within float tolerance)."""
    if quantization not in ("none", "auto", "exact"):
        return f"{fingerprint}+{quantization}"
    if quantization in ("auto", "exact") and built.quantized_matrices():
        # what "auto" resolved to on this CPU: KV computed with int8 activations differs
        return f"{fingerprint}+{'w4a8' if built.int8_activation_matrices() else 'exact'}"
    return fingerprint


def load_for_config(config) -> LoadedModel:
    """The model an EngineConfig describes (path, dtype, device, context, packing and
    quantization): the one place engines and workers load from, so no field is dropped."""
    return load_model(config.model or None, getattr(torch, config.dtype), config.device, config.max_model_len,
                      config.packed_weights, config.quantization)
