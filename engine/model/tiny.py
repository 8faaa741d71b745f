"""A tiny random Llama for fast tests and demos: same config type, same loading path
(`build_model`) and same kernels as the real model, a few layers, seeded."""
from __future__ import annotations

from pathlib import Path

import torch

from pdserve.engine.config import ModelConfig
from pdserve.engine.model.weights import LoadedModel, build_model


def tiny_config(**overrides) -> ModelConfig:
    base = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                rope_theta=10000.0, max_position_embeddings=1024, tie_word_embeddings=False,
                bos_token_id=1, eos_token_id=2)
    base.update(overrides)
    return ModelConfig(**base)


def tiny_state_dict(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights with Hugging Face names. The scale keeps logits peaked, so greedy
    choices are far from ties and comparisons across batch layouts are exact."""
    g = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        from pdserve.engine.model.weights import model_class
        shapes = {k: v.shape for k, v in model_class(cfg)(cfg).state_dict().items()}
    state = {}
    for name, shape in shapes.items():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        if name.endswith("norm.weight"):
            state[name] = 1.0 + 0.1 * torch.randn(shape, generator=g)
        else:
            state[name] = torch.randn(shape, generator=g) * (0.5 if "embed" in name else shape[-1] ** -0.5)
    return state


def tiny_llama(seed: int = 0, **overrides) -> LoadedModel:
    cfg = tiny_config(**overrides)
    return LoadedModel(build_model(cfg, tiny_state_dict(cfg, seed)), cfg, Path("<tiny>"), f"tiny-{seed}")
