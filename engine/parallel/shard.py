"""How a model splits over a tensor-parallel group: which heads, MLP units and vocabulary rows
each rank holds (Megatron-style; see tp.py), its part of each LoRA adapter, and the degrees a
model's heads allow."""
from __future__ import annotations

from dataclasses import replace

import torch

from pdserve.engine.config import ModelConfig
from pdserve.engine.parallel.degrees import check_degree, span  # noqa: F401 - the degrees a model allows

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # split by output
ROW = ("o_proj", "down_proj")  # split by input
VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


def kv_heads_of(cfg: ModelConfig, tp: int, rank: int) -> slice:
    kv = cfg.num_key_value_heads
    if tp <= kv:
        return span(kv, tp, rank)
    per = tp // kv  # ranks sharing one KV head
    return slice(rank // per, rank // per + 1)


def vocab_of(cfg: ModelConfig, tp: int, rank: int) -> slice:
    """Rank `rank`'s rows of the embedding and the LM head."""
    return span(cfg.vocab_size, tp, rank)


def _rows(cfg: ModelConfig, tp: int, rank: int) -> dict[str, slice]:
    """Rank `rank`'s part of each projection: its output rows of q/k/v and gate/up (the
    column-parallel ones), its input columns of o and down (the row-parallel ones)."""
    hd, heads = cfg.head_dim, span(cfg.num_attention_heads, tp, rank)
    kvh, mlp = kv_heads_of(cfg, tp, rank), span(cfg.intermediate_size, tp, rank)
    q, kv = slice(heads.start * hd, heads.stop * hd), slice(kvh.start * hd, kvh.stop * hd)
    return {"q_proj": q, "k_proj": kv, "v_proj": kv, "o_proj": q, "gate_proj": mlp, "up_proj": mlp, "down_proj": mlp}


def local_config(cfg: ModelConfig, tp: int, rank: int) -> ModelConfig:
    """The config of rank `rank`'s slice: its heads, MLP units and vocabulary rows."""
    heads, kvh = span(cfg.num_attention_heads, tp, rank), kv_heads_of(cfg, tp, rank)
    mlp, vocab = span(cfg.intermediate_size, tp, rank), vocab_of(cfg, tp, rank)
    return replace(cfg, num_attention_heads=heads.stop - heads.start, num_key_value_heads=kvh.stop - kvh.start,
                   intermediate_size=mlp.stop - mlp.start, head_dim=cfg.head_dim, vocab_size=vocab.stop - vocab.start)


def shard(state: dict[str, torch.Tensor], cfg: ModelConfig, tp: int, rank: int, vocab: bool = True
          ) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    """Rank `rank`'s weights (Hugging Face names) and the config of its slice (its vocabulary
    size: its rows of the embedding). `vocab` False: the embedding and LM head stay whole (a
    pipeline stage's tensor-parallel rank, engine/parallel/pp.py)."""
    check_degree(cfg, tp)
    rows, split = _rows(cfg, tp, rank), vocab
    vocab = vocab_of(cfg, tp, rank) if split else slice(None)
    out = {}
    for name, w in state.items():
        part = name.rsplit(".", 2)
        module = part[-2] if len(part) >= 2 else ""
        if module in COLUMN:
            w = w[rows[module]]
        elif module in ROW:
            w = w[:, rows[module]]
        elif name in VOCAB:
            w = w[vocab]
        out[name] = w.contiguous()
    local = local_config(cfg, tp, rank)
    return out, local if split else replace(local, vocab_size=cfg.vocab_size)


def shard_lora(pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]], cfg: ModelConfig, tp: int,
               rank: int) -> tuple[dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]], ModelConfig]:
    """Rank `rank`'s part of a LoRA adapter's (layer, projection) -> (A (r, in), B (out, r))
    pairs, split as the base weights: a column-parallel projection keeps A whole and B's rows
    of this rank's outputs; a row-parallel one A's columns of this rank's inputs and B whole,
    so the ranks' partial updates B (A_i x_i) sum to B A x in the layer's all-reduce. Also the
    slice's config (the shapes the parts fuse to)."""
    check_degree(cfg, tp)
    rows, out = _rows(cfg, tp, rank), {}
    for (layer, proj), (a, b) in pairs.items():
        if proj in COLUMN:
            out[layer, proj] = a.contiguous(), b[rows[proj]].contiguous()
        else:
            out[layer, proj] = a[:, rows[proj]].contiguous(), b.contiguous()
    return out, local_config(cfg, tp, rank)
