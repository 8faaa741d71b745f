"""Expert parallelism: a mixture-of-experts model's routed experts split over the ranks of a
group (the processes, gloo collectives and per-step broadcast of engine/parallel/tp.py, in its
`expert` mode), everything else whole on every rank.

Each rank holds every layer's attention, norms and dense MLPs, the embedding and the LM head,
and a contiguous range of each MoE layer's experts (`experts_of`: as even as possible, the
first ranks one more when the degree does not divide the experts); the shared expert
(Qwen2-MoE) only on rank 0, so that it is added once. Every rank runs rank 0's whole step on
every token. Dispatch is implicit: attention is replicated, so every rank already has every
token's hidden state and computes the same routing (no tokens move, where all-to-all expert
parallelism sends each token to its experts' ranks). Each rank computes the pairs of its own
experts (a rank none of whose experts was chosen adds zeros), and the combine is one
all-reduce per MoE layer summing the ranks' partial outputs (`SparseMoeBlock.tp`). Every rank
joins every all-reduce, however the router skews, so none waits on a rank that skipped one.
Rank 0 alone samples: the other ranks compute no logits.

Each rank's cache holds every KV head of every block (its own attention writes them), so a
KV export is rank 0's cache alone, and an import is broadcast to every rank (`EPKVCache`).
Tensor parallelism within an expert-parallel group is not implemented (EngineConfig refuses
both degrees above 1), nor are LoRA adapters on one (TensorParallel refuses them). A pipeline
of expert-parallel stages (PP x EP) is engine/parallel/pp.py's: each stage splits its own
layers' experts over its ranks this way, its combine over the stage's group.
"""
from __future__ import annotations

import re

import torch

from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.kv.cache import KVCache, kv_format
from pdserve.engine.model.moe import ExpertShare
from pdserve.engine.parallel.degrees import check_experts, experts_of, span  # noqa: F401 - the split

_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")


def shard_experts(state: dict[str, torch.Tensor], cfg: ModelConfig, ep: int, rank: int
                  ) -> tuple[dict[str, torch.Tensor], ExpertShare]:
    """Rank `rank`'s weights: all but the experts outside its range (and, off rank 0, the
    shared expert), under their checkpoint names; and its share."""
    check_experts(cfg, ep)
    share = ExpertShare(experts_of(cfg, ep, rank), shared=rank == 0)
    out = {}
    for name, w in state.items():
        m = _EXPERT.search(name)
        if m is not None and int(m.group(1)) not in share.owned:
            continue
        if not share.shared and ".mlp.shared_expert" in name:
            continue
        out[name] = w
    return out, share


def attach_experts(model, group) -> None:
    """Sum every MoE layer's partial outputs over the group (the combine)."""
    for block in model.moe_blocks():
        block.tp = group


def expert_load(model, ep: int, stages=None) -> list[tuple[int, int, int]]:
    """(expert, the rank that holds it, (token, expert) pairs routed to it so far) for each
    expert, summed over the MoE layers; [] for a dense model. Rank 0's counts are the group's:
    every rank routes every token the same way. A pipeline's: its stage's layers, their experts
    over the stage's ranks (numbered from 0, whatever `ep` says), plus, given `stages` (its
    PPKVCache), every later stage's layers (asked of them: call between steps, on rank 0)."""
    if not hasattr(model, "expert_tokens"):
        return []
    if getattr(model, "pp", None) is not None:  # PP x EP: the ranks of rank 0's stage, numbered from 0
        ep = model.pp.width
    tokens = model.expert_tokens()
    if stages is not None and hasattr(stages, "expert_tokens"):
        tokens = stages.expert_tokens(tokens)
    ranks = [r for r in range(ep) for _ in experts_of(model.config, ep, r)]
    return [(e, r, n) for e, (r, n) in enumerate(zip(ranks, tokens))]


class EPKVCache(KVCache):
    """One rank's paged cache, every KV head of the model in it: rank 0's export is the
    group's; rank 0's import is broadcast to the other ranks (told by rank 0's message, they
    take part in the same call)."""

    def __init__(self, cfg: ModelConfig, config: EngineConfig, group, int8_activations: bool = False):
        super().__init__(cfg, config.cache, kv_format(config.cache.kv_cache_dtype, getattr(torch, config.dtype),
                                                      config.device, int8_activations), config.device)
        self.group = group

    def export_blocks(self, block_ids: list[int], layers: tuple[int, int] | None = None,
                      announce: bool = True) -> torch.Tensor:
        """This rank's copy (every rank holds the same KV); `announce` as TPKVCache's: nothing
        is gathered, so nothing is announced."""
        return super().export_blocks(block_ids, layers)

    def import_blocks(self, block_ids: list[int], data: torch.Tensor | None) -> None:
        g = self.group
        if g.rank == 0:
            super().import_blocks(block_ids, data)  # checks the shape and dtype before anything is sent
            g.broadcast(("import", block_ids))
            g.broadcast_tensor(data.contiguous().cpu().view(-1).view(torch.uint8))  # any KV dtype, as bytes
            return
        shape = (self.kv.shape[0], 2, len(block_ids), *self.kv.shape[3:])
        raw = torch.empty(shape, dtype=self.kv.dtype).view(-1).view(torch.uint8)
        g.broadcast_tensor(raw)
        super().import_blocks(block_ids, raw.view(self.kv.dtype).view(shape))
