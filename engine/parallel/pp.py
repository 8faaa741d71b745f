"""Pipeline parallelism: a model's layers split over the ranks of a group (the processes, the
authenticated gloo group and the per-step message of engine/parallel/tp.py, in its
`pipeline` mode), each rank one stage (or, PP x TP below, each stage a group of ranks).

Stage r holds the contiguous layers `layers_of(cfg, pp, r, EngineConfig.pipeline_layers)`,
renumbered from 0 in its model, and a paged cache of those layers alone. The split
(`split_layers`) is the config's counts, or by default weighs stage 0's extra work (the LM
head, sampling, scheduling: `head_weight` layers' worth) so that its layers plus that work
match each other stage's layers, the rest as even as possible over the other stages. Rank 0
is the engine (scheduler, block manager, sampler) and stage 0: it sends each step to every
stage (point to point, not waited for: `Group.posted`, so it goes on while a stage
computes), embeds the tokens and runs its
layers, then sends the residual stream (T, hidden) to rank 1; each stage receives it, runs
its layers and sends it on; the last applies the final norm and sends the normed hidden
states back to rank 0, whose logits and sampling are those of one engine. The stages
compute the same sums in the same order as one engine's layers do, so their tokens and
logprobs are the single engine's exactly. With micro-batches in flight
(engine/core/micro_batches.py) rank 0's pass posts the residual stream and a receive for its
result (`Stage.defer`) and returns; `Stage.land` waits for the oldest result.

A prefill pipeline's KV leaves it by parts (engine/parallel/pp_handoff.py): each rank pushes
its own layers (and heads) straight to the decode ranks that own them, from its own process;
a decode pipeline receives by parts, each rank at an address of its own, writing its own. An
engine-level export or import (tests, a peer's prefix pull) is in the whole model's layout
(`PPKVCache`): an export gathers every stage's layers on rank 0 (concatenated along the layer
dimension), an import sends each stage its layer range. Rank 0's block manager is the group's:
a block id names the same block in every stage's cache, each rank holding as many blocks as
`kv_cache_memory` holds on the rank of the most layers (and KV heads). A stage that dies
makes the next send or receive fail: rank 0 raises `RankFailed`, as for a tensor-parallel rank.

PP x TP: with `EngineConfig.tensor_parallel_size` = w > 1 each stage is a tensor-parallel
group of w ranks (global rank = stage * w + its rank in the stage; `stage_group`): its layers
split Megatron-style (engine/parallel/shard.py) and their partial sums all-reduced within the
stage. Every rank of a stage holds the whole residual stream after each layer, so rank t of
stage s sends it to rank t of stage s + 1 (as vLLM's pipeline groups do, without its
all-gather shortcut), and the last stage's rank 0 alone sends the normed result to rank 0.
The vocabulary is not split (every rank keeps the whole embedding and LM head, as a pipeline
stage does): stage 0's ranks each embed the tokens, and rank 0 alone computes the logits.

PP x EP: with `EngineConfig.expert_parallel_size` = w > 1 (a mixture-of-experts model) each
stage is an expert-parallel group of w ranks instead (engine/parallel/ep.py within the stage):
every rank of a stage holds its layers' attention, norms and dense MLPs whole and its share of
their experts (the shared expert on the stage's first rank), runs every token through them
and sums its MoE layers' partial outputs over the stage's group; the residual stream moves
as under PP x TP. Each rank caches every KV head of its layers, so the stage's first rank
alone exports them (`owners`) and an import by parts reaches every rank of the stage. Such a
pipeline takes one pass at a time (engine/core/micro_batches.py keeps a mixture of experts'
batches whole).

Not in this slice: the native one-call decode step and layer-wise KV streaming mid-pass (a
step's streams export once the pass is through; a prefill worker ships by parts then), LoRA
and LoRA adapters. Every rank keeps the
embedding, the final norm and the LM head (stage 0's ranks use the embedding, the last
stage's first rank the norm, rank 0 the LM head).
"""
from __future__ import annotations

import re
import time
from collections import deque
from dataclasses import replace

import torch
import torch.distributed as dist

from pdserve.common.errors import KVTransferError
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.kv.cache import KVCache, bytes_per_block, kv_format
from pdserve.engine.parallel.ep import shard_experts
from pdserve.engine.parallel.group import Group
from pdserve.engine.parallel.pp_handoff import StagedHandoff
from pdserve.engine.parallel.degrees import (  # noqa: F401 - the split, where the stages are built
    HEAD_SCALE, check_stages, head_weight, layers_of, split_layers, span)
from pdserve.engine.parallel.shard import kv_heads_of, shard

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
def stage_width(config: EngineConfig, world: int) -> int:
    """Ranks in each stage of a pipeline group of `world` ranks: the config's tensor- or
    expert-parallel degree (EngineConfig allows one of them above 1; both 1: a stage is one
    process). Refuses a world it does not divide."""
    w = config.tensor_parallel_size * config.expert_parallel_size
    if world % w:
        kind = "expert-parallel" if config.expert_parallel_size > 1 else "tensor-parallel"
        raise ValueError(f"a pipeline group of {world} ranks cannot be split into stages of {w} {kind} "
                         f"ranks: use a multiple of {w}")
    return w


def stage_heads(full: ModelConfig, config: EngineConfig, t: int) -> slice:
    """The KV heads rank t of a stage holds: its tensor-parallel share of them, or all of
    them (a stage of expert-parallel ranks runs its attention whole on every rank)."""
    tp = config.tensor_parallel_size
    return kv_heads_of(full, tp, t) if tp > 1 else slice(0, full.num_key_value_heads)


def stage_state(state: dict[str, torch.Tensor], layers: range) -> dict[str, torch.Tensor]:
    """A stage's weights: the tensors of its layers, renumbered from 0, and every tensor that
    is not a layer's (the embedding, the final norm, the LM head)."""
    out = {}
    for name, w in state.items():
        m = _LAYER.match(name)
        if m is None:
            out[name] = w
        elif int(m.group(1)) in layers:
            out[f"model.layers.{int(m.group(1)) - layers.start}.{name[m.end():]}"] = w
    return out


def load_stage(source, config: EngineConfig, world: int, rank: int):
    """The LoadedModel of global rank `rank` of a pipeline group of `world` ranks (its config:
    the whole model's; its model: its stage's layers, each keeping its index in the whole
    model for per-layer settings such as sliding windows; with stages of w > 1 ranks, its
    tensor-parallel slice of them, the vocabulary whole, or under expert parallelism their
    attention whole and its share of their experts: ep.shard_experts), and the whole model's
    config."""
    from pdserve.engine.model.weights import LoadedModel, build_cached, quantized_fingerprint

    state, cfg, fp, path = source.read()
    if config.max_model_len:
        cfg = replace(cfg, max_position_embeddings=config.max_model_len)
    w = stage_width(config, world)
    check_stages(cfg, world // w, config.pipeline_layers)
    layers = layers_of(cfg, world // w, rank // w, config.pipeline_layers)
    part, local, share = stage_state(state, layers), cfg, None
    if w > 1 and config.expert_parallel_size > 1:
        part, share = shard_experts(part, cfg, w, rank % w)
    elif w > 1:
        part, local = shard(part, cfg, w, rank % w, vocab=False)
    model = build_cached(path, local, part, getattr(torch, config.dtype), config.device, config.packed_weights,
                         config.quantization, part=f"pp{world // w}r{rank // w}l{layers.start}-{layers.stop}tp{w}r{rank % w}",
                         experts=share, layers=layers)
    return LoadedModel(model, cfg, path, quantized_fingerprint(fp, config.quantization, model)), cfg


class Stage:
    """A model's place in a pipeline (`model.pp`): where its forward pass's residual stream
    comes from and goes to. `width`: ranks per stage (PP x TP); the group's rank r is rank
    r % width of stage r // width."""

    def __init__(self, group, width: int = 1):
        self.group, self.rank, self.world, self.width = group, group.rank, group.world, width
        self.stage, self.last = group.rank // width, (group.world // width - 1) * width  # last: its first rank
        self.sends = 0  # activations sent (a step's pass sends one per stage)
        self.idle_s = 0.0  # rank 0: seconds waiting for the last stage's output (the pipe's bubble)
        self.defer = False  # rank 0: a pass leaves its result in `landing` (a micro-batch in flight)
        self.landing: deque = deque()  # rank 0: (posted receive, its tensor) per micro-batch in flight
        self.broken: list = []  # rank 0: the landings of a pipe a stage broke (kept for gloo)

    def enter(self, model, input_ids: torch.Tensor) -> torch.Tensor:
        """The residual stream at this stage's first layer, (T, hidden): the embeddings on
        stage 0's ranks, else the previous stage's output (from its rank of this rank's place)."""
        if self.stage == 0:
            return model.embed(input_ids)
        dtype = model.model.embed_tokens.weight.dtype
        h = self.group.recv((input_ids.shape[0], model.config.hidden_size), dtype, self.rank - self.width)
        return h.to(input_ids.device)

    def leave(self, h: torch.Tensor, delta: torch.Tensor | None, finish) -> torch.Tensor:
        """After this stage's layers: the last stage's first rank sends `finish()` (the final
        norm, adding the pending `delta` of the fused path) back to rank 0 (its other ranks'
        results go nowhere); any other stage sends the residual stream h + delta on. Rank 0
        returns the final normed hidden states, or, with `defer`, posts h and a receive for
        them (`land`) and returns h. Stage 0's other ranks post theirs too: a blocking send
        would hold them out of rank 0's next micro-batch's all-reduces."""
        if self.stage == self.world // self.width - 1:
            if self.rank != self.last:
                return h
            out = finish()
            if self.rank != 0:
                self._send(out, 0)
            return out
        if delta is not None:
            h.add_(delta)  # what the next layer's fused norm would add first: the same fp32 sum
        nxt = self.rank + self.width
        if self.defer or (self.stage == 0 and self.rank != 0):
            # a copy: the native path may reuse h's memory in the next pass, before it left
            self.group.isend(h.clone(), nxt)
            self.sends += 1
            if self.defer:
                self.landing.append(self.group.irecv(tuple(h.shape), h.dtype, self.last))
            return h
        self._send(h, nxt)
        if self.rank != 0:
            return h
        t = time.perf_counter()
        out = self.group.recv(tuple(h.shape), h.dtype, self.last)
        self.idle_s += time.perf_counter() - t
        return out.to(h.device)

    def land(self, device) -> torch.Tensor:
        """Rank 0: the final normed hidden states of the oldest micro-batch in flight."""
        work, out = self.landing.popleft()
        t = time.perf_counter()
        self.group.finish(work, self.last)
        self.idle_s += time.perf_counter() - t
        return out.to(device)

    def _send(self, t: torch.Tensor, dst: int) -> None:
        self.group.send(t.cpu(), dst)
        self.sends += 1


def stage_group(store, rank: int, width: int, timeout_s: float, secret: bytes, on_failure=None) -> Group | None:
    """The tensor-parallel group of rank `rank`'s stage (None: stages of one rank): a Group of
    its stage's `width` ranks on the rendezvous store under the stage's own prefix, proving the
    same secret. Every rank of the pipeline forms it after the pipeline's group."""
    if width == 1:
        return None
    return Group(rank % width, width, dist.PrefixStore(f"stage{rank // width}", store), timeout_s, secret, on_failure)


def attach_stage(model, group, stage_tp: Group | None = None) -> None:
    """Make `model` (a stage's layers) one stage of `group`'s pipeline; rank 0's messages are
    posted (Group.posted) so that it can send a micro-batch's step while a stage computes another.
    `stage_tp`: its stage's group, which sums its layers' partial outputs (tensor-parallel: the
    attention's and MLPs'; expert-parallel, a mixture-of-experts model: the MoE layers' alone)."""
    model.pp = Stage(group, 1 if stage_tp is None else stage_tp.world)
    group.posted = True
    if stage_tp is not None and model.config.num_experts:
        for block in model.moe_blocks():  # the combine of ep.py, within the stage
            block.tp = stage_tp
        return
    for layer in model.model.layers if stage_tp is not None else ():
        layer.self_attn.tp = layer.mlp.tp = stage_tp


class PPKVCache(StagedHandoff, KVCache):
    """One rank's paged cache (its stage's layers; with PP x TP, its KV heads of them; with
    PP x EP, all their KV heads, on each rank of the stage). A
    hand-off moves by parts (StagedHandoff: `ship`, `serve_kv`, `expect_kv`, `take_kv`);
    `export_blocks` and `import_blocks` of the whole model's layout gather every rank's part
    on rank 0 and send each its part (the other ranks take part, told by rank 0's broadcast)."""

    def __init__(self, full: ModelConfig, config: EngineConfig, group, int8_activations: bool = False):
        w = self.width = stage_width(config, group.world)
        self.spans = [layers_of(full, group.world // w, r // w, config.pipeline_layers)  # per global rank
                      for r in range(group.world)]
        self.heads = [stage_heads(full, config, r % w) for r in range(group.world)]
        shapes = [replace(full, num_hidden_layers=len(s), num_key_value_heads=h.stop - h.start)
                  for s, h in zip(self.spans, self.heads)]
        fmt = kv_format(config.cache.kv_cache_dtype, getattr(torch, config.dtype), config.device, int8_activations)
        # every rank as many blocks as kv_cache_memory holds on the rank of the most layers and heads (a
        # block id names the same block everywhere); the others take that many blocks' bytes
        per = max(bytes_per_block(m, config.cache.block_size, fmt) for m in shapes)
        if config.cache.kv_cache_memory < per:
            raise ValueError(f"kv_cache_memory={config.cache.kv_cache_memory} bytes holds no block: one block of "
                             f"{config.cache.block_size} tokens needs {per} bytes on this model's largest stage")
        mine = bytes_per_block(shapes[group.rank], config.cache.block_size, fmt)
        cache = replace(config.cache, kv_cache_memory=config.cache.kv_cache_memory // per * mine)
        super().__init__(shapes[group.rank], cache, fmt, config.device)
        self.full, self.group = full, group
        # each stage's ranks whose heads make up the whole (one per replicated head; expert-parallel: its first)
        kv, tp = full.num_key_value_heads, config.tensor_parallel_size
        self.owners = list(range(tp)) if tp <= kv else list(range(0, tp, tp // kv))
        self.settle = None  # rank 0: lands the micro-batches in flight first (its engine's MicroBatches)

    @property
    def layout(self) -> tuple[int, ...]:
        _, two, bs, _, hd = super().layout
        return (self.full.num_hidden_layers, two, bs, self.full.num_key_value_heads, hd)

    def _part(self, r: int, lo: int, hi: int) -> tuple[int, int]:
        """Rank r's share of the whole model's layers [lo, hi), in its own numbering."""
        s = self.spans[r]
        a, b = max(lo, s.start), min(hi, s.stop)
        return (a - s.start, max(a, b) - s.start)

    def _shape(self, r: int, layers: tuple[int, int], n: int) -> tuple[int, ...]:
        h = self.heads[r]
        return (layers[1] - layers[0], 2, n, self.block_size, h.stop - h.start, self.kv.shape[-1])

    def export_blocks(self, block_ids: list[int], layers: tuple[int, int] | None = None,
                      announce: bool = True) -> torch.Tensor:
        """Rank 0: the blocks' KV of layers [start, end) (all: None) of the whole model. Always
        announced, whatever `announce` says: a pipeline's step streams its KV once the pass is
        through (runner.py), when the other ranks wait for rank 0's next message."""
        g, w = self.group, self.width
        lo, hi = layers or (0, self.full.num_hidden_layers)
        if g.rank == 0 and self.settle is not None:  # the parts come under tag 0, as the results do
            self.settle()
        if g.rank == 0 and g.world > 1:
            g.broadcast(("export", block_ids, layers))
        mine = super().export_blocks(block_ids, self._part(g.rank, lo, hi))
        if g.rank != 0:
            if g.rank % w in self.owners:
                g.send(mine.cpu(), 0)
            return mine
        stages = []
        for s in range(0, g.world, w):
            parts = [mine if r == 0 else g.recv(self._shape(r, self._part(r, lo, hi), len(block_ids)),
                                                self.kv.dtype, r).to(mine.device)
                     for r in (s + t for t in self.owners)]
            stages.append(torch.cat(parts, dim=4))
        return torch.cat(stages)

    def import_blocks(self, block_ids: list[int], data: torch.Tensor | None) -> None:
        """`data`: the whole model's KV, or rank 0's part alone (a hand-off by parts, pp_handoff.py)."""
        g = self.group
        if g.rank == 0 and data is not None and data.shape[0] != self.full.num_hidden_layers:
            return self.take_kv(block_ids, data)
        if g.rank != 0:
            part = g.recv(self._shape(g.rank, self._part(g.rank, 0, self.full.num_hidden_layers), len(block_ids)),
                          self.kv.dtype, 0)
            return super().import_blocks(block_ids, part)
        expected = (self.full.num_hidden_layers, 2, len(block_ids), *self.layout[2:])
        if tuple(data.shape) != expected or data.dtype != self.kv.dtype:  # refused before any rank is told
            raise KVTransferError(f"KV data has shape {tuple(data.shape)} and dtype {data.dtype}, expected "
                                  f"{expected} and {self.kv.dtype}")
        if self.settle is not None:
            self.settle()
        if g.world > 1:
            g.broadcast(("import", block_ids))
        for r in range(1, g.world):
            g.send(self._of(data, r).cpu(), r)
        super().import_blocks(block_ids, self._of(data, 0))

    def expert_tokens(self, own: list[int]) -> list[int]:
        """Rank 0: the (token, expert) pairs routed to each expert, summed over every stage's
        MoE layers (`own`: stage 0's); each later stage's first rank sends its own
        (`send_expert_tokens`: a stage's ranks route its tokens alike)."""
        g, w = self.group, self.width
        if g.world == w:
            return own
        if self.settle is not None:  # the counts come under tag 0, as the results do
            self.settle()
        g.broadcast(("experts",))
        total = torch.tensor(own, dtype=torch.long)
        for r in range(w, g.world, w):
            total += g.recv((len(own),), torch.long, r)
        return total.tolist()

    def send_expert_tokens(self, model) -> None:
        """A stage's first rank past stage 0: its MoE layers' counts to rank 0."""
        if self.group.rank % self.width == 0:
            self.group.send(torch.tensor(model.expert_tokens(), dtype=torch.long), 0)

    def _of(self, data: torch.Tensor, r: int) -> torch.Tensor:
        """Rank r's part of the whole model's KV `data`: its layers, its KV heads."""
        return data[self.spans[r].start:self.spans[r].stop, :, :, :, self.heads[r]].contiguous()
