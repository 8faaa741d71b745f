"""How a model splits over a tensor-parallel group: which heads, MLP units and vocabulary rows
each rank holds (Megatron-style; see tp.py), and the degrees a model's heads allow."""
from __future__ import annotations

from dataclasses import replace

import torch

from pdserve.engine.config import ModelConfig

ATTN = ("q_proj", "k_proj", "v_proj")
VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


def check_degree(cfg: ModelConfig, tp: int) -> None:
    """Refuse a degree the model's heads cannot be split into, naming the degrees that work."""
    h, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    ok = h % tp == 0 and (kv % tp == 0 or tp % kv == 0)
    if tp < 1 or not ok:
        good = [d for d in range(1, h + 1) if h % d == 0 and (kv % d == 0 or d % kv == 0)]
        raise ValueError(f"tensor-parallel degree {tp} does not divide this model's {h} attention heads "
                         f"({kv} KV heads): use one of {', '.join(map(str, good))}")


def _span(n: int, tp: int, rank: int) -> slice:
    """Rank `rank`'s part of n units split as evenly as possible (the first n % tp get one more)."""
    base, extra = divmod(n, tp)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (rank < extra))


def kv_heads_of(cfg: ModelConfig, tp: int, rank: int) -> slice:
    kv = cfg.num_key_value_heads
    if tp <= kv:
        return _span(kv, tp, rank)
    per = tp // kv  # ranks sharing one KV head
    return slice(rank // per, rank // per + 1)


def vocab_of(cfg: ModelConfig, tp: int, rank: int) -> slice:
    """Rank `rank`'s rows of the embedding and the LM head."""
    return _span(cfg.vocab_size, tp, rank)


def shard(state: dict[str, torch.Tensor], cfg: ModelConfig, tp: int, rank: int
          ) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    """Rank `rank`'s weights (Hugging Face names) and the config of its slice (its vocabulary
    size: its rows of the embedding)."""
    check_degree(cfg, tp)
    hd, heads = cfg.head_dim, _span(cfg.num_attention_heads, tp, rank)
    kvh = kv_heads_of(cfg, tp, rank)
    mlp = _span(cfg.intermediate_size, tp, rank)
    vocab = vocab_of(cfg, tp, rank)
    rows = {"q_proj": slice(heads.start * hd, heads.stop * hd), "k_proj": slice(kvh.start * hd, kvh.stop * hd)}
    rows["v_proj"] = rows["k_proj"]
    out = {}
    for name, w in state.items():
        part = name.rsplit(".", 2)
        module = part[-2] if len(part) >= 2 else ""
        if module in ATTN:
            w = w[rows[module]]
        elif module == "o_proj":
            w = w[:, rows["q_proj"]]
        elif module in ("gate_proj", "up_proj"):
            w = w[mlp]
        elif module == "down_proj":
            w = w[:, mlp]
        elif name in VOCAB:
            w = w[vocab]
        out[name] = w.contiguous()
    local = replace(cfg, num_attention_heads=heads.stop - heads.start, num_key_value_heads=kvh.stop - kvh.start,
                    intermediate_size=mlp.stop - mlp.start, head_dim=hd, vocab_size=vocab.stop - vocab.start)
    return out, local
