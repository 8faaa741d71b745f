"""Mixture-of-experts checkpoints to the names engine/model/moe.py loads by.

Hugging Face directories come in two layouts: one tensor per expert matrix, as the released
checkpoints and `save_pretrained` write them (Mixtral's `block_sparse_moe.experts.{e}.w1/w3/w2`
and `block_sparse_moe.gate`; Qwen3-MoE's and OLMoE's `mlp.experts.{e}.gate_proj/up_proj/down_proj`
and `mlp.gate`, the names used here), or transformers' in-memory fused layout (3-D
`mlp.experts.gate_up_proj` (E, 2I, H) and `mlp.experts.down_proj` (E, H, I)). GGUF files
(llama.cpp) hold each layer's experts as 3-D `blk.{n}.ffn_{gate,up,down}_exps.weight`, one slice
per expert, and the router as `ffn_gate_inp` (older Mixtral files: `ffn_gate.{e}.weight`
per expert); Qwen2-MoE's shared expert as `ffn_{gate,up,down}_shexp` and its gate as
`ffn_gate_inp_shexp`. Mixtral ships in GGUF as architecture "llama" with `llama.expert_count` set.
"""
from __future__ import annotations

import re

import torch

from pdserve.common.errors import ModelLoadError
from pdserve.engine.config import ModelConfig

_MIXTRAL = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_GGUF_EXPERT = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
_GGUF_SHARED = {"ffn_gate_shexp": "shared_expert.gate_proj", "ffn_up_shexp": "shared_expert.up_proj",
                "ffn_down_shexp": "shared_expert.down_proj", "ffn_gate_inp_shexp": "shared_expert_gate"}


def hf_expert_names(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """`state` with Mixtral's expert names and fused expert tensors renamed/split to
    `mlp.gate` and `mlp.experts.{e}.{gate,up,down}_proj.weight`."""
    out = {}
    for name, t in state.items():
        name = name.replace(".block_sparse_moe.", ".mlp.")
        m = re.fullmatch(r"(.*\.mlp\.experts\.\d+)\.(w[123])\.weight", name)
        if m:
            out[f"{m.group(1)}.{_MIXTRAL[m.group(2)]}.weight"] = t
            continue
        m = re.fullmatch(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)", name)
        if m:
            out.update(_split_fused(m.group(1), m.group(2), t, cfg))
            continue
        out[name] = t
    return out


def checkpoint_names(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """`state` (moe.py's names) under the names the family's checkpoints use: Mixtral's
    `block_sparse_moe.gate` and `block_sparse_moe.experts.{e}.w1/w3/w2`; the others unchanged."""
    if cfg.model_type != "mixtral":
        return dict(state)
    back = {v: k for k, v in _MIXTRAL.items()}
    out = {}
    for name, t in state.items():
        m = re.fullmatch(r"(.*)\.mlp\.(gate|experts\.\d+\.(\w+))\.weight", name)
        if m and (m.group(3) is None or m.group(3) in back):
            tail = "gate" if m.group(3) is None else f"{m.group(2).rsplit('.', 1)[0]}.{back[m.group(3)]}"
            name = f"{m.group(1)}.block_sparse_moe.{tail}.weight"
        out[name] = t
    return out


def _split_fused(prefix: str, kind: str, t: torch.Tensor, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    E, I, H = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    want = (E, 2 * I, H) if kind == "gate_up_proj" else (E, H, I)
    if tuple(t.shape) != want:
        raise ModelLoadError(f"tensor {prefix}.{kind} has shape {tuple(t.shape)}, the config expects {want}")
    out = {}
    for e in range(E):
        if kind == "gate_up_proj":
            out[f"{prefix}.{e}.gate_proj.weight"], out[f"{prefix}.{e}.up_proj.weight"] = t[e].chunk(2)
        else:
            out[f"{prefix}.{e}.down_proj.weight"] = t[e]
    return out


_GGUF_EXPERT_TENSOR = re.compile(
    r"blk\.\d+\.ffn_(gate_inp|(gate|up|down)_exps|(gate|up|down)\.\d+|(gate_inp|gate|up|down)_shexp)\.weight")


def is_expert_tensor(name: str) -> bool:
    """Whether GGUF tensor `name` is a layer's router, holds its experts or is its shared expert's."""
    return _GGUF_EXPERT_TENSOR.fullmatch(name) is not None


def gguf_expert_tensors(name: str, arr, num_experts: int) -> dict:
    """The Hugging Face names and (numpy) slices of GGUF tensor `name`, a router or experts
    (`is_expert_tensor`). A 3-D tensor must hold `num_experts` slices."""
    m = re.fullmatch(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight", name)
    if m:
        if arr.ndim != 3 or arr.shape[0] != num_experts:
            raise ModelLoadError(f"GGUF tensor {name!r} has shape {tuple(arr.shape)}: expected one slice per "
                                 f"expert ({num_experts}, as expert_count says)")
        base = f"model.layers.{m.group(1)}.mlp.experts"
        return {f"{base}.{e}.{_GGUF_EXPERT[m.group(2)]}.weight": arr[e] for e in range(num_experts)}
    m = re.fullmatch(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight", name)  # older Mixtral files
    if m:
        return {f"model.layers.{m.group(1)}.mlp.experts.{m.group(3)}.{_GGUF_EXPERT[m.group(2)]}.weight": arr}
    layer, kind = name.split(".")[1:3]
    if kind in _GGUF_SHARED:  # Qwen2-MoE's shared expert; its gate llama.cpp stores as a vector
        return {f"model.layers.{layer}.mlp.{_GGUF_SHARED[kind]}.weight": arr.reshape(1, -1) if arr.ndim == 1 else arr}
    return {f"model.layers.{layer}.mlp.gate.weight": arr}  # ffn_gate_inp: the router
