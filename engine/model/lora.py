"""LoRA adapters in PEFT's format, loaded onto a base Llama-family or Gemma 3 model.

An adapter directory holds `adapter_config.json` (`peft_type` "LORA", `r`, `lora_alpha`,
`use_rslora`, `target_modules`) and `adapter_model.safetensors`, whose tensors are named
`base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_{A|B}.weight`: A is (r, in),
B is (out, r), and the layer's output becomes `base(x) + x @ A.T @ B.T * scaling`, scaling
being `lora_alpha / r` (`lora_alpha / sqrt(r)` with rsLoRA).

The base model fuses q/k/v into one matrix and gate/up into another (engine/model/llama.py,
whose attention and MLP engine/model/gemma3.py reuses)
and runs them on quantized kernels, so the update is not merged into the weights: it is added
to the base linear's output, each projection's update in its slice of the fused output. Per
fused matrix an adapter keeps one `LoRAModule`: the A matrices of its targeted slices stacked
(sum of ranks, in) and one B (out, sum of ranks) holding each slice's B, scaled, in its rows
and columns (zero elsewhere), so an update is two matmuls whatever the slices.
engine/model/lora_batch.py applies them to a step's rows, engine/core/lora_registry.py keeps
the resident ones (its docstring says how a worker loads adapters and passes one per request:
`LLMEngine.load_lora(name, dir)`, then `add_request(..., lora=name)`; docs/lora.md).

A bad adapter fails with a named `LoRAError`: `LoRAFilesMissingError`, `LoRAUnsupportedError`
(a module or PEFT feature this engine does not run), `LoRAShapeError` (made for another base)
and `LoRARankError` (rank above `LoRAConfig.max_lora_rank`).
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pdserve.common.errors import ModelLoadError
from pdserve.engine.config import ModelConfig

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# each fused matrix of a layer and the projections stacked in it, in order
FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
         "down": ("down_proj",)}
SECTION = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# PEFT config fields that change the math this module implements (refused when set)
_UNSUPPORTED = {"use_dora": "DoRA", "modules_to_save": "modules_to_save", "rank_pattern": "per-module ranks",
                "alpha_pattern": "per-module alphas", "fan_in_fan_out": "fan_in_fan_out (Conv1D layers)",
                "layers_to_transform": "layers_to_transform", "lora_bias": "LoRA biases",
                "trainable_token_indices": "trainable tokens", "alora_invocation_tokens": "activated LoRA",
                "layer_replication": "layer_replication", "target_parameters": "target_parameters",
                "use_qalora": "QA-LoRA", "use_bdlora": "block-diagonal LoRA", "arrow_config": "Arrow routing"}


class LoRAError(ModelLoadError):
    """An adapter cannot be loaded onto this model; the message names the file, key or field."""


class LoRAFilesMissingError(LoRAError):
    """The adapter directory lacks adapter_config.json or adapter_model.safetensors."""


class LoRAUnsupportedError(LoRAError):
    """The adapter targets a module other than the q/k/v/o/gate/up/down projections, or uses a
    PEFT feature (DoRA, biases, per-module ranks...) this engine does not run."""


class LoRAShapeError(LoRAError):
    """A tensor's shape does not fit the base model (an adapter made for another base), or an
    A has no B."""


class LoRARankError(LoRAError):
    """The adapter's rank is above the engine's `max_lora_rank`."""


@dataclass
class LoRAModule:
    """One fused matrix's low-rank update: `y += (x @ a.T) @ b.T` (scaling folded into b)."""

    a: torch.Tensor  # (sum of the targeted slices' ranks, in)
    b: torch.Tensor  # (out of the fused matrix, sum of ranks)


@dataclass
class LoRAAdapter:
    """An adapter loaded for one base model. `layers[i]` maps a fused matrix ("qkv", "o",
    "gate_up", "down") to its update; matrices the adapter leaves alone are absent."""

    name: str
    path: Path
    rank: int
    scaling: float
    targets: tuple[str, ...]  # the projections it updates (q_proj, ...)
    digest: str               # sha256 of its config's math fields and its weights file
    layers: list[dict[str, LoRAModule]] = field(repr=False, default_factory=list)
    id: int = 0               # set by the registry at each load (engine/core/lora_registry.py)

    @property
    def identity(self) -> str:
        """Name and weights digest: folded into the root of its requests' block hashes
        (common/block_hash.root_hash), so no cached block is shared with the base, another
        adapter, or another adapter loaded later under this name."""
        return f"{self.name}@{self.digest[:32]}"

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for m in layer.values() for t in (m.a, m.b))


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of each projection of a layer of `cfg`."""
    h, q, kv, i = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, \
        cfg.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}


def read_adapter_files(path: str | Path) -> tuple[dict, bytes]:
    """The adapter's config dict and its weights file's bytes."""
    path = Path(path)
    if not path.is_dir():
        raise LoRAFilesMissingError(f"LoRA adapter directory {str(path)!r} does not exist")
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (path / name).is_file():
            other = " (adapter_model.bin is not read: save with safetensors)" if name == WEIGHTS_FILE else ""
            raise LoRAFilesMissingError(f"LoRA adapter {str(path)!r} has no {name}{other}")
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError) as e:
        raise LoRAError(f"{path / CONFIG_FILE}: not a JSON file ({e})") from e
    if not isinstance(config, dict):
        raise LoRAError(f"{path / CONFIG_FILE}: expected a JSON object")
    return config, (path / WEIGHTS_FILE).read_bytes()


def check_config(config: dict, where: str, max_rank: int) -> tuple[int, float]:
    """The adapter's rank and scaling from its config; a named error for what is not run here."""
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAUnsupportedError(f"{where}: peft_type {config.get('peft_type')!r}, only LORA adapters are run")
    for key, what in _UNSUPPORTED.items():
        if config.get(key):
            raise LoRAUnsupportedError(f"{where}: {key} is set ({what}): not supported")
    if config.get("bias", "none") != "none":
        raise LoRAUnsupportedError(f"{where}: bias={config['bias']!r}: adapters with biases are not supported")
    targets = config.get("target_modules")
    if isinstance(targets, list) and (bad := sorted(set(targets) - set(SECTION))):
        raise LoRAUnsupportedError(f"{where}: target_modules {bad} not supported: LoRA runs on "
                                   f"{', '.join(SECTION)}")
    r, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(r, int) or r < 1 or not isinstance(alpha, (int, float)):
        raise LoRAError(f"{where}: r must be a positive integer and lora_alpha a number, got {r!r}, {alpha!r}")
    if r > max_rank:
        raise LoRARankError(f"{where}: rank {r} is above this engine's max_lora_rank ({max_rank})")
    return r, alpha / (math.sqrt(r) if config.get("use_rslora") else r)


def read_tensors(blob: bytes, where: str, cfg: ModelConfig, r: int) -> dict[tuple[int, str], tuple]:
    """(layer, projection) -> (A, B) from the safetensors bytes, every shape checked."""
    from safetensors.torch import load as load_safetensors

    try:
        tensors = load_safetensors(blob)
    except Exception as e:  # safetensors raises its own error types on a corrupt file
        raise LoRAError(f"{where}/{WEIGHTS_FILE}: not a safetensors file ({e})") from e
    shapes, found = projection_shapes(cfg), {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None or m.group(3) not in SECTION or SECTION[m.group(3)] != m.group(2):
            raise LoRAUnsupportedError(f"{where}: tensor {key!r} is not a LoRA A/B of a q/k/v/o/gate/up/down "
                                       "projection (embeddings, the LM head and DoRA are not supported)")
        layer, proj, which = int(m.group(1)), m.group(3), m.group(4)
        if cfg.num_experts and SECTION[proj] == "mlp" and layer not in cfg.dense_layers:
            raise LoRAUnsupportedError(f"{where}: tensor {key!r} updates an MLP projection of a mixture-of-experts "
                                       "layer: adapters on experts are not supported (attention only)")
        if layer >= cfg.num_hidden_layers:
            raise LoRAShapeError(f"{where}: tensor {key!r} is for layer {layer}; the base has "
                                 f"{cfg.num_hidden_layers} layers")
        out, inp = shapes[proj]
        want = (r, inp) if which == "A" else (out, r)
        if tuple(t.shape) != want:
            raise LoRAShapeError(f"{where}: tensor {key!r} has shape {tuple(t.shape)}, this base expects {want} "
                                 f"(rank {r}): an adapter made for another model?")
        found.setdefault((layer, proj), {})[which] = t
    for (layer, proj), pair in found.items():
        if len(pair) != 2:
            raise LoRAShapeError(f"{where}: layer {layer} {proj} has lora_{next(iter(pair))} but not its pair")
    if not found:
        raise LoRAError(f"{where}/{WEIGHTS_FILE}: no LoRA tensors")
    return {k: (v["A"], v["B"]) for k, v in found.items()}


def fuse_layer(pairs: dict[str, tuple], shapes: dict[str, tuple[int, int]], scaling: float,
               dtype: torch.dtype, device) -> dict[str, LoRAModule]:
    """One layer's (A, B) per projection as one `LoRAModule` per fused matrix."""
    out: dict[str, LoRAModule] = {}
    for fused, projs in FUSED.items():
        hit = [p for p in projs if p in pairs]
        if not hit:
            continue
        a = torch.cat([pairs[p][0] for p in hit]).to(torch.float32)
        b = torch.zeros(sum(shapes[p][0] for p in projs), a.shape[0])
        row, col = 0, 0
        for p in projs:
            if p in pairs:  # this slice's rows of the fused output, its rank's columns
                rank = pairs[p][0].shape[0]
                b[row:row + shapes[p][0], col:col + rank] = pairs[p][1].float() * scaling
                col += rank
            row += shapes[p][0]
        out[fused] = LoRAModule(a.to(device, dtype).contiguous(), b.to(device, dtype).contiguous())
    return out


def load_adapter(name: str, path: str | Path, cfg: ModelConfig, max_rank: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 split=None) -> LoRAAdapter:
    """Load the PEFT adapter in directory `path` for a base of config `cfg`, its update in
    `dtype` on `device`. Raises a `LoRAError` subclass naming what is wrong. `split(pairs,
    cfg)`: a tensor-parallel rank's part of the checked (layer, projection) -> (A, B) pairs
    and its slice's config (engine/parallel/shard.shard_lora); None: the whole adapter."""
    where = str(path)
    config, blob = read_adapter_files(path)
    r, scaling = check_config(config, where, max_rank)
    pairs = read_tensors(blob, where, cfg, r)
    if split is not None:
        pairs, cfg = split(pairs, cfg)
    shapes = projection_shapes(cfg)
    layers = [fuse_layer({p: ab for (i, p), ab in pairs.items() if i == layer}, shapes, scaling, dtype, device)
              for layer in range(cfg.num_hidden_layers)]
    # what changes the update: the weights and the config fields read above
    math_fields = {k: config.get(k) for k in ("r", "lora_alpha", "use_rslora")}
    digest = hashlib.sha256(json.dumps(math_fields, sort_keys=True).encode() + b"\x00" + blob).hexdigest()
    targets = tuple(sorted({p for _, p in pairs}, key=list(SECTION).index))
    return LoRAAdapter(name, Path(path), r, scaling, targets, digest, layers)
