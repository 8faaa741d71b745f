"""Mixture-of-experts decoders (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): the Llama decoder with
each layer's MLP replaced by a router and a set of SwiGLU experts (plus, in Qwen2-MoE, a shared
expert every token runs, its output scaled by sigmoid(shared_expert_gate(x))).

A token's MLP output is the weighted sum of its top-k experts' outputs: the router's logits
(one linear layer, `mlp.gate`) go through a softmax, the k largest probabilities are kept
and, where the family says so (`norm_topk_prob`: always for Mixtral, per config for the
others), rescaled to sum to 1, as Hugging Face's `*TopKRouter` modules compute them.

The experts run grouped: the step's (token, expert) pairs are sorted by expert, each expert
that got any runs one matmul over its rows, and the weighted outputs are added back into
their tokens' rows (`index_add_`, experts in ascending order, as transformers sums them), so
only the chosen experts' weights are read (on CUDA the same grouping runs as two Triton
launches, engine/kernels/triton_moe.py). Each expert is a `LlamaMLP`: `fuse` gives it the
linear kernels of engine/model/quant.py (oneDNN fp32, or a quantized kernel per expert
matrix under "auto"), and the fused C SwiGLU when native ops are on. A `SparseMoeBlock`
computes only the experts in its `owned` range; the others' pairs are skipped: an
expert-parallel rank (engine/parallel/ep.py) holds only its range (`keep`: the others are
`AbsentExpert`s, without weights) and its `tp` group sums the ranks' partial outputs. Each
block counts the (token, expert) pairs its router chose (`routed`, every expert's, owned or
not), which a worker's /metrics reports as expert load.

Parameter names are the Qwen-MoE and OLMoE checkpoint names (`mlp.gate.weight`,
`mlp.experts.{e}.{gate,up,down}_proj.weight`, `mlp.shared_expert.*`, `mlp.shared_expert_gate`);
Mixtral's names and transformers' fused expert tensors are renamed at load
(engine/model/moe_weights.py). OLMoE's q/k RMSNorm spans the whole projection, not each head.
The one-call C decode step (native_step.why_not) does not take these models; their steps run
the layer loop of `LlamaForCausalLM.forward`.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.config import ModelConfig
from pdserve.engine.model.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, RMSNorm, token_embedding
from pdserve.engine.model.lora_batch import LoRALayer
from pdserve.engine.model.quant import make_linear


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's top-k experts and their weights: softmax (in fp32) over the router's
    (T, num_experts) logits, the k largest kept, rescaled to sum to 1 if `renormalize`.
    Returns (weights (T, k) in the logits' dtype, expert ids (T, k))."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), experts


@dataclass(frozen=True)
class ExpertShare:
    """The experts one expert-parallel rank computes: `owned`, its range of every MoE layer's
    routed experts, and `shared`, whether it computes the shared expert (one rank does, so it
    is added once)."""

    owned: range
    shared: bool


class AbsentExpert(nn.Module):
    """In place of an expert another rank holds: no weights, never called (its pairs are
    outside the block's `owned` range)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("an expert held by another expert-parallel rank was called")


@dataclass(frozen=True)
class ExpertGroup:
    """One expert's share of a step: the token rows routed to it and their routing weights."""

    expert: int
    rows: torch.Tensor     # (n,) token rows, ascending
    weights: torch.Tensor  # (n,) the router's weight of this expert for each row


def group_by_expert(experts: torch.Tensor, weights: torch.Tensor, num_experts: int,
                    owned: range | None = None) -> list[ExpertGroup]:
    """The (token, expert) pairs of (T, k) `experts`/`weights`, grouped by expert in ascending
    order; experts no pair chose, or outside `owned`, get no group."""
    k = experts.shape[1]
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs by expert, each expert's by token
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    rows, pair_weights = order // k, weights.reshape(-1)[order]
    groups, start = [], 0
    for e, n in enumerate(counts):
        if n and (owned is None or e in owned):
            groups.append(ExpertGroup(e, rows[start:start + n], pair_weights[start:start + n]))
        start += n
    return groups


class SparseMoeBlock(nn.Module):
    """Router plus experts in place of a layer's MLP; see the module docstring."""

    gelu = False  # experts are SwiGLU (LlamaForCausalLM.use_native_ops reads this)

    def __init__(self, cfg: ModelConfig, owned: range | None = None):
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        expert_cfg = replace(cfg, intermediate_size=cfg.moe_intermediate_size)
        self.experts = nn.ModuleList(LlamaMLP(expert_cfg) for _ in range(cfg.num_experts))
        self.shared_expert = self.shared_expert_gate = self.shared_gate_linear = None
        if cfg.shared_expert_intermediate_size:  # Qwen2-MoE: one more expert for every token, gated by a sigmoid
            self.shared_expert = LlamaMLP(replace(cfg, intermediate_size=cfg.shared_expert_intermediate_size))
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        self.owned = owned or range(cfg.num_experts)  # the experts this block computes (all, without EP)
        self.gate_linear = None
        self.gate_up_weight: torch.Tensor | None = None  # (owned E, 2 I, H) once fused; the experts' are views
        self.down_weight: torch.Tensor | None = None     # (owned E, H, I)
        self.triton = False  # the experts by engine/kernels/triton_moe.py (set by fuse on CUDA)
        self.tp = None  # an expert-parallel group: it sums the ranks' partial outputs (engine/parallel/ep.py)
        self.routed: torch.Tensor | None = None  # (E,) pairs routed to each expert so far (from fuse on)

    def keep(self, share: ExpertShare) -> None:
        """Hold only `share`'s experts (the others become `AbsentExpert`s) and the shared
        expert only if `share.shared`. Called before the weights load (they load by name)."""
        for e in range(self.num_experts):
            if e not in share.owned:
                self.experts[e] = AbsentExpert()
        self.owned = share.owned
        if not share.shared:
            self.shared_expert = self.shared_expert_gate = None

    @property
    def native(self) -> bool:
        return self.experts[self.owned.start].native

    @native.setter
    def native(self, on: bool) -> None:
        for expert in self.mlps():
            expert.native = on

    def fuse(self, packed: bool, quantization: str = "none") -> None:
        """Stack the experts' gate/up and down matrices ((E, 2I, H), (E, H, I): one tensor each,
        the grouped kernels' layout), each expert's named weights and kernels on views of
        them. The router keeps fp32 (`none`): which experts run must not move with quantization."""
        mine = [self.experts[e] for e in self.owned]  # (E, ...) stacks of the owned experts only
        gate_up = torch.stack([torch.cat([e.gate_proj.weight.data, e.up_proj.weight.data]) for e in mine])
        down = torch.stack([e.down_proj.weight.data for e in mine])
        for expert, gu, d in zip(mine, gate_up, down):
            expert.gate_proj.weight.data, expert.up_proj.weight.data = gu.chunk(2)
            expert.down_proj.weight.data = d
            expert.gate_up_weight = gu
            expert.gate_up_linear = make_linear(gu, quantization, packed)
            expert.down_linear = make_linear(d, quantization, packed)
        self.gate_up_weight, self.down_weight = gate_up, down
        # the Triton kernel indexes the stacks by expert id: all experts only (a rank's share runs the loop)
        self.triton = gate_up.is_cuda and _triton_installed() and len(mine) == self.num_experts
        self.routed = torch.zeros(self.num_experts, dtype=torch.long, device=gate_up.device)
        self.gate_linear = make_linear(self.gate.weight.data, "none", packed)
        if self.shared_expert is not None:
            self.shared_expert.fuse(packed, quantization)
            self.shared_gate_linear = make_linear(self.shared_expert_gate.weight.data, "none", packed)

    def forward(self, x: torch.Tensor, lora: LoRALayer | None = None, within=None) -> torch.Tensor:
        """x: (T, hidden). Returns the experts' weighted sum per row, (T, hidden). `lora` is
        not applied to experts (adapters update attention only on these models). `within()`,
        if given, is called after each expert's rows (points where the step may pause)."""
        logits = self.gate(x) if self.gate_linear is None else self.gate_linear(x)  # (T, E)
        weights, experts = route(logits, self.top_k, self.renormalize)  # (T, k) each
        if self.routed is not None:
            self.routed += torch.bincount(experts.reshape(-1), minlength=self.num_experts)
        if self.triton:  # one grouped launch for gate/up, one for down
            from pdserve.engine.kernels import triton_moe
            out = triton_moe.moe_experts(x, experts, weights, self.gate_up_weight, self.down_weight, self.owned)
        else:
            out = torch.zeros_like(x)
            for g in group_by_expert(experts, weights, self.num_experts, self.owned):
                y = self.experts[g.expert](x[g.rows])  # (n, hidden): this expert's weights only
                out.index_add_(0, g.rows, y * g.weights.unsqueeze(-1))
                if within is not None:
                    within()
        if self.shared_expert is not None:
            gate = self.shared_expert_gate(x) if self.shared_gate_linear is None else self.shared_gate_linear(x)
            out += torch.sigmoid(gate) * self.shared_expert(x)  # (T, 1) * (T, hidden)
        return out if self.tp is None else self.tp.all_reduce(out)

    def mlps(self) -> list[LlamaMLP]:
        """The owned experts, then the shared expert where this block has one."""
        return [self.experts[e] for e in self.owned] + ([] if self.shared_expert is None else [self.shared_expert])

    def linears(self) -> list:
        return [self.gate_linear, self.shared_gate_linear] + [
            lin for e in self.mlps() for lin in (e.gate_up_linear, e.down_linear)]


def _triton_installed() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


class OlmoeAttention(LlamaAttention):
    """OLMoE's attention: RMSNorm over the whole q projection and the whole k projection
    (one weight of n_heads * head_dim and one of n_kv * head_dim), before RoPE. Runs fused
    (build_model fuses every model)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        self.q_norm = RMSNorm(self.n_heads * self.hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.n_kv * self.hd, cfg.rms_norm_eps)

    def _norm_qk(self, qkv: torch.Tensor) -> None:
        nq, nk = self.n_heads * self.hd, self.n_kv * self.hd
        q, k = qkv[:, :nq], qkv[:, nq:nq + nk]
        q.copy_(self.q_norm(q))
        k.copy_(self.k_norm(k))


class MoeDecoderLayer(LlamaDecoderLayer):
    """A Llama decoder layer whose MLP is a `SparseMoeBlock` (a `LlamaMLP` for the layers
    the config lists as dense)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        nn.Module.__init__(self)
        self.self_attn = (OlmoeAttention if cfg.model_type == "olmoe" else LlamaAttention)(cfg, layer_idx)
        self.mlp = LlamaMLP(cfg) if layer_idx in cfg.dense_layers else SparseMoeBlock(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MoeModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = token_embedding(cfg)
        self.layers = nn.ModuleList(MoeDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MoeForCausalLM(LlamaForCausalLM):
    """An MoE decoder and LM head with `LlamaForCausalLM`'s interface (fuse, kernels, forward
    over a flat batch, compute_logits)."""

    amx_prompts = False  # the experts take subsets of a step's rows: every row runs on W4A8

    decoder = MoeModel

    def _linears(self) -> list:
        out = [self.lm_head_linear]
        for layer in self.model.layers:
            out += [layer.self_attn.qkv_linear, layer.self_attn.o_linear]
            mlp = layer.mlp
            out += mlp.linears() if isinstance(mlp, SparseMoeBlock) else [mlp.gate_up_linear, mlp.down_linear]
        return out

    def moe_blocks(self) -> list[SparseMoeBlock]:
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, SparseMoeBlock)]

    def keep_experts(self, share: ExpertShare) -> None:
        """Hold only an expert-parallel rank's share of each MoE layer (`SparseMoeBlock.keep`)."""
        for block in self.moe_blocks():
            block.keep(share)

    def expert_tokens(self) -> list[int]:
        """(token, expert) pairs routed to each expert so far, summed over the MoE layers (every
        expert's: each rank routes every token)."""
        counts = [b.routed for b in self.moe_blocks() if b.routed is not None]
        return torch.stack(counts).sum(0).tolist() if counts else [0] * self.config.num_experts


def reference_moe(x: torch.Tensor, block: SparseMoeBlock) -> torch.Tensor:
    """Every expert over every row, masked by the routing (the dense definition the grouped
    path must equal; for tests)."""
    weights, experts = route(F.linear(x, block.gate.weight), block.top_k, block.renormalize)
    out = torch.zeros_like(x)
    for e, expert in enumerate(block.experts):
        w = (weights * (experts == e)).sum(-1, keepdim=True)  # (T, 1): 0 where e was not chosen
        act = F.silu(F.linear(x, expert.gate_proj.weight)) * F.linear(x, expert.up_proj.weight)
        out += w * F.linear(act, expert.down_proj.weight)
    return out
