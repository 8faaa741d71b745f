"""Gemma 3 (text): the Llama decoder's parts arranged Gemma's way.

What differs from `LlamaForCausalLM` (engine/model/llama.py), as in Hugging Face's
`Gemma3ForCausalLM`: the embeddings are scaled by sqrt(hidden_size); every RMSNorm multiplies
by (1 + w) (the loader adds the 1 to the weights, so the norms here are plain); q and k get a
per-head RMSNorm before RoPE; each layer has four norms (before and after attention, before
and after the MLP, the "after" ones applied to the branch before the residual add); the MLP
is GELU-tanh gated; scores are scaled by query_pre_attn_scalar^-1/2; sliding-window layers
and global layers interleave, each kind with its own RoPE base. The attention, the linear
kernels and the paged cache are the Llama model's.

LoRA adapters (engine/model/lora.py) update q/k/v/o/gate/up/down through the Llama layers'
hooks: the q/k/v update lands before the q/k norms, the gate/up one before GeGLU, as PEFT
adds them. Gemma 3 never takes the one-call C decode step (qk-norm, GeGLU and sliding windows:
native_step.why_not), so its steps, adapter rows included, run this layer loop; the updates
are computed by the C LoRA routine on the C kernels, by the Triton kernel on CUDA or on the
Triton attention backend, else by torch ops (engine/model/lora_batch.py).
"""
from __future__ import annotations

import torch
from torch import nn

from pdserve.engine.config import ModelConfig
from pdserve.engine.model.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, RMSNorm, RotaryEmbedding, token_embedding
from pdserve.engine.model.lora_batch import LoRABatch, LoRALayer


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx)
        self.mlp = LlamaMLP(cfg)
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)

    def forward(self, h, rope, kv, meta, backend, lora: LoRALayer | None = None, within=None):
        a = self.self_attn(self.input_layernorm(h), rope, kv, meta, backend, lora)
        h = h + self.post_attention_layernorm(a)
        if within is not None:
            within()
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h), lora, within))


class Gemma3Model(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = token_embedding(cfg)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3's decoder and LM head, with `LlamaForCausalLM`'s interface (fuse, kernels,
    forward over a flat batch, compute_logits)."""

    decoder = Gemma3Model
    amx_prompts = False  # its forward is its own; every row runs on W4A8

    def build_rotary(self) -> None:
        """The RoPE tables: the global layers' base and the sliding layers' (computed, not loaded)."""
        cfg = self.config
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)
        self.rotary_local = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings,
                                            cfg.rope_local_theta or cfg.rope_theta)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta,
                after_layer=None, lora: LoRABatch | None = None) -> torch.Tensor:
        """As LlamaForCausalLM.forward (the residual adds are not fused into the norms here:
        Gemma's norms sit on the branches). `lora`: which rows run under which adapter."""
        if lora is not None:
            lora.use_kernels_of(self)
        h = self.embed(input_ids)
        h = h * torch.tensor(self.config.hidden_size ** 0.5, dtype=h.dtype)  # rounded to the dtype, as HF does
        rope_global = self.rotary(positions, self.native_ops)
        rope_local = self.rotary_local(positions, self.native_ops)
        within = getattr(after_layer, "within", None)  # pause points inside a layer (kv_hooks)
        for i, (layer, kv) in enumerate(zip(self.model.layers, kv_caches)):
            h = layer(h, rope_local if layer.self_attn.window else rope_global, kv, meta, self.backend,
                      None if lora is None else lora.layer(i), within)
            if after_layer is not None:
                after_layer(i)
        return self.model.norm(h)
