"""The degrees a model can be split into, and how its units split (pure, torch-free): tensor
parallelism's heads (shard.py), expert parallelism's experts (ep.py) and pipeline stages'
layers (pp.py). `pdserve up` refuses a degree with these before anything starts; the ranks
split their weights by the same functions."""
from __future__ import annotations

import math

from pdserve.engine.config import ModelConfig

# stage 0's extra work in a pipeline (the LM head, sampling, scheduling, less what the last stage does
# beyond its layers) in layers' time over its LM head's multiply-adds in layers': SmolLM2 at PP=2 and 32
# streams, one thread a stage: 15 layers and 15 (w = 0.8 of 8.0) against 13 and 17 (the factor 0.55) gave
# 0.98-1.13x the tokens/s over four runs and rank 0 idle 8-12% of its time against 11-26% (bench/NOTES.md,
# the nineteenth session), once the head took 8-row tiles and greedy sampling its argmax in C
HEAD_SCALE = 0.1


def span(n: int, tp: int, rank: int) -> slice:
    """Rank `rank`'s part of n units split as evenly as possible (the first n % tp get one more;
    heads and units in shard.py, experts in ep.py, a pipeline's later stages' layers)."""
    base, extra = divmod(n, tp)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (rank < extra))


def check_degree(cfg: ModelConfig, tp: int) -> None:
    """Refuse a tensor-parallel degree the model's heads cannot be split into, naming the
    degrees that work."""
    if tp > 1 and cfg.num_experts:
        raise ValueError(f"tensor-parallel degree {tp}: a mixture-of-experts model ({cfg.model_type}) is not "
                         "split by tensor parallelism (not implemented): use 1, or expert parallelism (--ep)")
    h, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    ok = h % tp == 0 and (kv % tp == 0 or tp % kv == 0)
    if tp < 1 or not ok:
        good = [d for d in range(1, h + 1) if h % d == 0 and (kv % d == 0 or d % kv == 0)]
        raise ValueError(f"tensor-parallel degree {tp} does not divide this model's {h} attention heads "
                         f"({kv} KV heads): use one of {', '.join(map(str, good))}")


def check_experts(cfg: ModelConfig, ep: int) -> None:
    """Refuse a degree the model's experts cannot be split into."""
    if not cfg.num_experts:
        raise ValueError(f"expert-parallel degree {ep}: this {cfg.model_type} model is dense (no experts to "
                         "split): use 1 (or tensor parallelism, --tp)")
    if not 1 <= ep <= cfg.num_experts:
        raise ValueError(f"expert-parallel degree {ep}: this model has {cfg.num_experts} experts per layer: use "
                         f"1 to {cfg.num_experts}")


def experts_of(cfg: ModelConfig, ep: int, rank: int) -> range:
    """The experts rank `rank` holds: its contiguous share of each MoE layer's."""
    s = span(cfg.num_experts, ep, rank)
    return range(s.start, s.stop)


def check_stages(cfg: ModelConfig, pp: int, layers: tuple[int, ...] = ()) -> None:
    """Refuse a degree the model's layers cannot be split into, naming the degrees that fit, and
    a split `layers` (EngineConfig.pipeline_layers) that is not one count >= 1 a stage summing
    to the layers, naming the weighted split as one that fits."""
    if cfg.model_type == "gemma3" and pp > 1:
        raise ValueError(f"pipeline-parallel degree {pp}: a {cfg.model_type} model is not split into stages yet "
                         "(its own forward pass): use 1")
    n = cfg.num_hidden_layers
    if not 1 <= pp <= n:
        raise ValueError(f"pipeline-parallel degree {pp}: this model has {n} layers: use 1 to {n}")
    if layers and (len(layers) != pp or min(layers) < 1 or sum(layers) != n):
        fits = ",".join(map(str, split_layers(cfg, pp)))
        raise ValueError(f"pipeline layers {','.join(map(str, layers))}: this model's {n} layers over {pp} stages "
                         f"need {pp} counts of at least 1 (stage 0 first) that sum to {n}, e.g. {fits}")


def head_weight(cfg: ModelConfig) -> float:
    """Stage 0's work beyond its layers in layer-equivalents, from the model's shapes: the LM
    head's multiply-adds for a decoded row (hidden x vocab) over one layer's for a token (its
    attention projections and MLP, a mixture of experts' routed and shared experts), times
    HEAD_SCALE (what the head, sampling and scheduling cost beside the layers, measured)."""
    hd = cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
    attn = cfg.hidden_size * hd * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
    if cfg.num_experts:
        mlp = 3 * cfg.hidden_size * ((cfg.moe_intermediate_size or cfg.intermediate_size) * cfg.num_experts_per_tok
                                     + cfg.shared_expert_intermediate_size)
    else:
        mlp = 3 * cfg.hidden_size * cfg.intermediate_size
    return HEAD_SCALE * cfg.hidden_size * cfg.vocab_size / (attn + mlp)


def split_layers(cfg: ModelConfig, pp: int, layers: tuple[int, ...] = ()) -> tuple[int, ...]:
    """Layers of each stage, stage 0 first: `layers` when given, else the weighted split: stage 0
    takes (L + w) / pp - w of the L layers, rounded half up (w: head_weight; at least 1, at most
    L - (pp - 1)), so that its layers plus w match each other stage's share; the rest as even as possible
    over the other stages, the first of them one more."""
    if layers:
        return tuple(layers)
    n = cfg.num_hidden_layers
    if pp == 1:
        return (n,)
    w = head_weight(cfg)
    first = min(max(1, math.floor((n + w) / pp - w + 0.5)), n - pp + 1)
    rest = [span(n - first, pp - 1, r) for r in range(pp - 1)]
    return (first, *(s.stop - s.start for s in rest))


def layers_of(cfg: ModelConfig, pp: int, rank: int, layers: tuple[int, ...] = ()) -> range:
    """The layers stage `rank` holds, of the split `split_layers(cfg, pp, layers)`."""
    counts = split_layers(cfg, pp, layers)
    start = sum(counts[:rank])
    return range(start, start + counts[rank])
