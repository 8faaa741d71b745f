"""Llama-family decoder in plain torch (RMSNorm, RoPE, GQA attention, SwiGLU MLP), with
the relatives' variations as config fields: q/k/v biases (Qwen2), a per-head RMSNorm of q
and k before RoPE (Qwen3), sliding-window attention on all layers or some (Mistral, Qwen2).

Parameter names match Hugging Face's `LlamaForCausalLM` (`Qwen2ForCausalLM`,
`Qwen3ForCausalLM`, `MistralForCausalLM`) checkpoints so weights load by name.
The model works on a flat batch: every scheduled token of every request is one row of a
`(T, hidden)` tensor, so the linear layers see one big matmul per step; attention over the
paged KV cache is delegated to an `AttentionBackend` (engine/kernels/attention.py) that knows which
rows belong to which request.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.kernels import native
from pdserve.engine.kernels.attention import (AMX_PROMPT_ROWS, BF16_PROMPTS_FROM, AttentionBackend,
                                              AttentionMetadata, TorchAttentionBackend)
from pdserve.engine.config import ModelConfig
from pdserve.engine.model import native_step
from pdserve.engine.model.lora_batch import LoRABatch, LoRALayer
from pdserve.engine.model.packed_cache import PackedForms
from pdserve.engine.model.quant import (PromptRows, Q8A16Linear, W4A8Linear, WeightOnlyLinear, amx_prompt_rows,
                                        bf16_attention_from, make_linear)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # weight * x / sqrt(mean(x^2) + eps), one fused op
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables (HF's rotate-half convention), indexed by absolute position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float):
        super().__init__()
        # on the CPU even inside a meta-device context (a model's construction): torch's meta
        # versions of these ops import torch._dynamo, ~2 s of every worker's start
        cpu = torch.device("cpu")
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=cpu).float() / head_dim))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32, device=cpu), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # (max_positions, head_dim)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, native: bool = False) -> "Rope":
        return Rope(self, positions, native)


class Rope:
    """RoPE at one step's positions, applied to every layer's q and k: by the fused C kernel
    in place on the qkv projection's output (`native`, CPU fp32), else by torch ops on
    (T, 1, head_dim) cos/sin rows gathered once per step."""

    def __init__(self, rotary: RotaryEmbedding, positions: torch.Tensor, use_native: bool):
        self.native = use_native
        if use_native:
            # checked once here, not in each layer's call
            self.positions = native.rope_positions(positions, rotary.cos.shape[0])
            self.cos_table, self.sin_table = rotary.cos, rotary.sin
        else:
            self.cos, self.sin = rotary.cos[positions].unsqueeze(1), rotary.sin[positions].unsqueeze(1)

    def qkv(self, qkv: torch.Tensor, n_heads: int, n_kv: int, hd: int):
        """Split a fused (T, (n_heads + 2 n_kv) hd) projection into rotated q, k and v, each
        (T, heads, hd); `qkv` is overwritten on the native path."""
        T = qkv.shape[0]
        if self.native:
            native.rope_(qkv, self.positions, self.cos_table, self.sin_table, n_heads + n_kv, hd, checked=True)
            q, k, v = qkv.split((n_heads * hd, n_kv * hd, n_kv * hd), dim=-1)
            return q.view(T, n_heads, hd), k.view(T, n_kv, hd), v.view(T, n_kv, hd)
        q, k, v = qkv.split((n_heads * hd, n_kv * hd, n_kv * hd), dim=-1)
        return self.rotate(q.view(T, n_heads, hd)), self.rotate(k.view(T, n_kv, hd)), v.view(T, n_kv, hd)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        if self.cos.dtype != x.dtype:  # the tables are fp32; rotated in the model's dtype, as transformers does
            self.cos, self.sin = self.cos.to(x.dtype), self.sin.to(x.dtype)
        return apply_rope(x, self.cos, self.sin)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.hd, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.hd, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.hd, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.window = cfg.window_of(layer_idx)  # sliding-window attention (0: the whole context)
        # the kernels scale scores by head_dim^-1/2; Gemma's by query_pre_attn_scalar^-1/2
        pre = cfg.query_pre_attn_scalar
        self.q_scale = (self.hd / pre) ** 0.5 if pre and pre != self.hd else 0.0
        self.qkv_weight: torch.Tensor | None = None  # set by fuse()
        self.qkv_bias: torch.Tensor | None = None
        self.qkv_linear = self.o_linear = None
        self.tp = None  # a tensor-parallel group (engine/parallel/tp.py): o_proj's partial sums are all-reduced

    def fuse(self, packed: bool, quantization: str = "none", prompt_rows: PromptRows | None = None,
             forms: PackedForms | None = None) -> None:
        """Store q/k/v as one matrix (one matmul per step); the named weights become views of it.
        `prompt_rows`: the model's, where its prompt rows run on AMX; `forms`: its load's
        recorded or replayed grid forms (quant.make_linear)."""
        w = torch.cat([self.q_proj.weight.data, self.k_proj.weight.data, self.v_proj.weight.data])
        sizes = (self.n_heads * self.hd, self.n_kv * self.hd, self.n_kv * self.hd)
        for proj, view in zip((self.q_proj, self.k_proj, self.v_proj), w.split(sizes)):
            proj.weight.data = view
        self.qkv_weight = w
        if self.q_proj.bias is not None:
            b = torch.cat([self.q_proj.bias.data, self.k_proj.bias.data, self.v_proj.bias.data])
            for proj, view in zip((self.q_proj, self.k_proj, self.v_proj), b.split(sizes)):
                proj.bias.data = view
            self.qkv_bias = b
        self.qkv_linear = make_linear(w, quantization, packed, prompt_rows, forms)
        self.o_linear = make_linear(self.o_proj.weight.data, quantization, packed, prompt_rows, forms)

    def forward(self, x, rope: Rope, kv: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, backend: AttentionBackend, lora: LoRALayer | None = None) -> torch.Tensor:
        """`lora`: the step's adapters at this layer (engine/model/lora_batch.py), on a fused model."""
        T = x.shape[0]
        if self.qkv_weight is not None:
            qkv = self.qkv_linear(x)
            if self.qkv_bias is not None:
                qkv += self.qkv_bias
            if lora is not None:  # before the norms and RoPE, which act on the projection's output
                lora.add("qkv", x, qkv)
            if self.qk_norm:
                self._norm_qk(qkv)
            q, k, v = rope.qkv(qkv, self.n_heads, self.n_kv, self.hd)
        else:
            q, k = self.q_proj(x).view(T, self.n_heads, self.hd), self.k_proj(x).view(T, self.n_kv, self.hd)
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = rope.rotate(q), rope.rotate(k)  # (T, n_heads, hd), (T, n_kv, hd)
            v = self.v_proj(x).view(T, self.n_kv, self.hd)
        if self.q_scale:
            q = q * self.q_scale
        out = backend.forward(q, k, v, kv[0], kv[1], meta, self.window)  # (T, n_heads, hd)
        out = out.reshape(T, self.n_heads * self.hd)
        y = self.o_proj(out) if self.o_linear is None else self.o_linear(out)
        if lora is not None:
            lora.add("o", out, y)
        return y if self.tp is None else self.tp.all_reduce(y)


    def _norm_qk(self, qkv: torch.Tensor) -> None:
        """Qwen3's RMSNorm over each head of q and of k, in place in the fused projection
        (RoPE then rotates them there)."""
        T, nq, nk = qkv.shape[0], self.n_heads * self.hd, self.n_kv * self.hd
        q, k = qkv[:, :nq], qkv[:, nq:nq + nk]
        q.copy_(self.q_norm(q.reshape(T, self.n_heads, self.hd)).view(T, nq))
        k.copy_(self.k_norm(k.reshape(T, self.n_kv, self.hd)).view(T, nk))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up_weight: torch.Tensor | None = None
        self.gate_up_linear = self.down_linear = None
        self.native = False  # silu(gate) * up by the fused C kernel (set by LlamaForCausalLM.fuse)
        self.gelu = cfg.hidden_activation == "gelu_pytorch_tanh"  # Gemma's GeGLU, else SwiGLU
        self.tp = None  # a tensor-parallel group: down_proj's partial sums are all-reduced

    def fuse(self, packed: bool, quantization: str = "none", prompt_rows: PromptRows | None = None,
             forms: PackedForms | None = None) -> None:
        w = torch.cat([self.gate_proj.weight.data, self.up_proj.weight.data])
        self.gate_proj.weight.data, self.up_proj.weight.data = w.chunk(2)
        self.gate_up_weight = w
        self.gate_up_linear = make_linear(w, quantization, packed, prompt_rows, forms)
        self.down_linear = make_linear(self.down_proj.weight.data, quantization, packed, prompt_rows, forms)

    def forward(self, x: torch.Tensor, lora: LoRALayer | None = None, within=None) -> torch.Tensor:
        """`within()`, if given, is called between the gate/up matmul and the down one (a
        point where the step may pause for a peer's urgent step)."""
        out = self._partial(x, lora, within)
        return out if self.tp is None else self.tp.all_reduce(out)

    def _partial(self, x: torch.Tensor, lora: LoRALayer | None, within=None) -> torch.Tensor:
        if self.gate_up_weight is not None:
            gate_up = self.gate_up_linear(x)
            if lora is not None:
                lora.add("gate_up", x, gate_up)
            if within is not None:
                within()
            if self.native:
                act = native.silu_mul(gate_up)
                return self._down(act, lora)
            gate, up = gate_up.chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
            if within is not None:
                within()
        act = (F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)) * up
        return self.down_proj(act) if self.down_linear is None else self._down(act, lora)

    def _down(self, act: torch.Tensor, lora: LoRALayer | None) -> torch.Tensor:
        y = self.down_linear(act)
        return y if lora is None else lora.add("down", act, y)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, rope, kv, meta, backend, lora: LoRALayer | None = None, within=None):
        """`within()`, if given, is called at the points inside the layer where a step may
        pause (after the attention, after the MLP's first matmul)."""
        h = h + self.self_attn(self.input_layernorm(h), rope, kv, meta, backend, lora)
        if within is not None:
            within()
        return h + self.mlp(self.post_attention_layernorm(h), lora, within)


def token_embedding(cfg: ModelConfig) -> nn.Embedding:
    """The embedding, uninitialised: the loader's weights replace it, and nn.Embedding's own
    random init of a meta tensor imports torch._dynamo (~2 s of every worker's start)."""
    return nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = token_embedding(cfg)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The decoder plus LM head. `forward` returns final hidden states; `compute_logits` the
    vocabulary logits of the rows that need sampling (the LM head is the largest matmul, so it
    only runs on those)."""

    # a rank of a tensor-parallel group (engine/parallel/tp.py) holds the vocabulary rows
    # [vocab_start, vocab_start + its embedding's rows) of the embedding and the LM head
    tp = None
    vocab_start = 0
    native_decode = None  # the C decode step's weights (engine/model/native_step.py), when the model qualifies
    pp = None  # a pipeline stage (engine/parallel/pp.Stage): the residual stream comes from and goes to others

    decoder = LlamaModel  # the embedding and layers (a relative's own, in its subclass)
    amx_prompts = True  # whether fuse may put prompt rows on AMX (a relative whose forward sets no PromptRows: False)

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend | None = None):
        super().__init__()
        self.config = cfg
        self.model = self.decoder(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.build_rotary()
        self.backend = backend or TorchAttentionBackend()
        self.lm_head_linear = None
        self.native_ops = False  # RoPE and SwiGLU by the fused C kernels (engine/kernels/native/fused.c)
        self.prompt_rows: PromptRows | None = None  # set by fuse where prompt rows run on AMX
        self.bf16_prompts_from: int | None = None  # by fuse where prompt rows from there attend in bf16 vectors

    def build_rotary(self) -> None:
        """The RoPE tables (computed, not loaded: fp32 for accuracy)."""
        cfg = self.config
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)

    def fuse(self, packed: bool = False, quantization: str = "none",
             forms: PackedForms | None = None) -> "LlamaForCausalLM":
        """Fuse q/k/v and gate/up into single matrices for inference (weights unchanged) and
        pick each matrix's kernel (engine/model/quant.py). With `packed`, fp32 CPU matrices get a
        oneDNN-packed copy; with `quantization`, an int8 or fp16 copy; the named weights stay as
        loaded. Under "auto" with AMX the Q4_1 matrices run each step's prompt rows in bf16
        (`prompt_rows`); with AVX-512 BF16 and no AMX, long prompt rows attend in bf16 (`bf16_prompts_from`).
        `forms` (engine/model/packed_cache.py): where a dense model's grid forms are recorded or replayed."""
        on_cpu = self.lm_head.weight.device.type == "cpu" and self.lm_head.weight.dtype == torch.float32
        self.prompt_rows = amx_prompt_rows(quantization) if self.amx_prompts and on_cpu else None
        self.bf16_prompts_from = bf16_attention_from(quantization) if on_cpu and self.prompt_rows is None else None
        rows = {} if self.prompt_rows is None else {"prompt_rows": self.prompt_rows}
        if forms is not None:
            rows["forms"] = forms
        for layer in self.model.layers:
            layer.self_attn.fuse(packed, quantization, **rows)
            layer.mlp.fuse(packed, quantization, **rows)
        # q4_1 keeps the LM head in int8, as GGUF Q4_1 checkpoints ship it (Q8_0): in 4 bits it
        # alone raised SmolLM2's perplexity 4%; "auto" keeps it as shipped
        head = "int8" if quantization == "q4_1" else quantization
        self.lm_head_linear = make_linear(self.lm_head.weight.data, head, packed, forms=forms)
        return self

    def quantized_matrices(self) -> int:
        """How many of the fused matrices run on a quantized kernel."""
        return sum(1 for lin in self._linears() if isinstance(lin, (WeightOnlyLinear, W4A8Linear, Q8A16Linear)))

    def int8_activation_matrices(self) -> int:
        """How many of the fused matrices quantize their activations to int8 (W4A8Linear)."""
        return sum(1 for lin in self._linears() if isinstance(lin, W4A8Linear))

    def _linears(self) -> list:
        return [self.lm_head_linear] + [lin for layer in self.model.layers
                                        for lin in (layer.self_attn.qkv_linear, layer.self_attn.o_linear,
                                                    layer.mlp.gate_up_linear, layer.mlp.down_linear)]

    def use_native_ops(self, on: bool = True) -> "LlamaForCausalLM":
        """Run RoPE, SwiGLU and each residual add with its RMSNorm on the fused C kernels (fp32
        CPU weights, fused by `fuse`; the kernels must load, see engine/kernels/native). Off: the same
        math in torch ops."""
        if on and not (self.lm_head.weight.device.type == "cpu" and self.lm_head.weight.dtype == torch.float32
                       and self.model.layers[0].mlp.gate_up_weight is not None):
            raise ValueError("the native elementwise kernels need a fused fp32 model on the CPU")
        if on:
            native.load()
        self.native_ops = on
        for layer in self.model.layers:
            layer.mlp.native = on and not layer.mlp.gelu
        # decode-only steps then run all layers in one C call where the model is the common case
        self.native_decode = native_step.prepare(self) if on else None
        return self

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata, after_layer=None, lora: LoRABatch | None = None) -> torch.Tensor:
        """input_ids, positions: (T,). kv_caches: per layer (K, V) paged tensors.
        after_layer(i): called once layer i has written its K/V (layer-wise KV streaming), its
        `within()` inside each layer; the native step calls them there too (or reads a stop word).
        lora: which rows run under which adapter (None: all on the base model).
        Returns the final normed hidden states, (T, hidden)."""
        if lora is not None:
            lora.use_kernels_of(self)
        meta.backend_state[BF16_PROMPTS_FROM] = self.bf16_prompts_from  # None: every row in fp32
        if self.native_ops and native_step.usable(self, kv_caches, meta, after_layer, lora):
            if self.pp is None:
                stop, hook = getattr(after_layer, "native_stop", None), native_step.c_hook(after_layer)
                return native_step.forward(self, input_ids, positions, kv_caches, meta, lora, stop, hook=hook)
            # a pipeline stage: one C call over its layers (a group's steps never stop midway); h
            # comes out as the residual stream the next stage takes, the result as the final norm
            h = self.pp.enter(self, input_ids).contiguous()
            out = native_step.forward(self, input_ids, positions, kv_caches, meta, lora, h=h)
            return self.pp.leave(h, None, lambda: out)
        if self.prompt_rows is None:
            return self._layers(input_ids, positions, kv_caches, meta, after_layer, lora)
        self.prompt_rows.set(meta.prompt_ranges(), input_ids.shape[0])
        meta.backend_state[AMX_PROMPT_ROWS] = self.prompt_rows.ranges  # their attention on AMX too
        try:
            return self._layers(input_ids, positions, kv_caches, meta, after_layer, lora)
        finally:
            self.prompt_rows.clear()

    def _layers(self, input_ids, positions, kv_caches, meta, after_layer, lora) -> torch.Tensor:
        """The layer loop in Python (`forward`'s arguments)."""
        h = self.embed(input_ids) if self.pp is None else self.pp.enter(self, input_ids)  # (T, hidden)
        rope = self.rotary(positions, self.native_ops)
        if self.native_ops:
            return self._forward_fused_norms(h, rope, kv_caches, meta, after_layer, lora)
        within = getattr(after_layer, "within", None)  # pause points inside a layer (kv_hooks)
        for i, (layer, kv) in enumerate(zip(self.model.layers, kv_caches)):
            h = layer(h, rope, kv, meta, self.backend, None if lora is None else lora.layer(i), within)
            if after_layer is not None:
                after_layer(i)
        return self.model.norm(h) if self.pp is None else self.pp.leave(h, None, lambda: self.model.norm(h))

    def _forward_fused_norms(self, h, rope, kv_caches, meta, after_layer, lora=None) -> torch.Tensor:
        """The layers with each residual add fused into the RMSNorm that follows it (one C
        pass, native.add_rms_norm): the MLP's output is added by the next layer's input norm,
        the last one by the final norm. h, the residual stream, is updated in place."""
        delta, within = None, getattr(after_layer, "within", None)
        for i, (layer, kv) in enumerate(zip(self.model.layers, kv_caches)):
            norm_in, norm_post = layer.input_layernorm, layer.post_attention_layernorm
            at = None if lora is None else lora.layer(i)
            a = layer.self_attn(native.add_rms_norm(h, delta, norm_in.weight, norm_in.eps), rope, kv, meta,
                                self.backend, at)
            if within is not None:
                within()
            delta = layer.mlp(native.add_rms_norm(h, a, norm_post.weight, norm_post.eps), at, within)
            if after_layer is not None:
                after_layer(i)
        norm = self.model.norm
        if self.pp is not None:  # a pipeline stage: h + delta moves on, the last stage norms it
            return self.pp.leave(h, delta, lambda: native.add_rms_norm(h, delta, norm.weight, norm.eps))
        return native.add_rms_norm(h, delta, norm.weight, norm.eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings of `input_ids`. Vocabulary-parallel: each rank looks up the ids in
        its rows (zeros for the others) and the group sums them, exactly (one term is nonzero)."""
        if self.tp is None:
            return self.model.embed_tokens(input_ids)
        rows = self.model.embed_tokens.weight.shape[0]
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < rows)
        h = self.model.embed_tokens(local.clamp(0, rows - 1)) * mine.unsqueeze(-1).to(self.model.embed_tokens.weight.dtype)
        return self.tp.all_reduce(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits over the vocabulary, (rows, vocab). Vocabulary-parallel: each rank computes
        its rows' logits and rank 0 gets them all (the other ranks get None)."""
        out = self.lm_head(hidden) if self.lm_head_linear is None else self.lm_head_linear(hidden)
        return out if self.tp is None else self.tp.gather_columns(out.contiguous())
