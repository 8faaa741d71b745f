"""Pipeline parallelism: a model's layers split over the ranks of a group (the processes, the
authenticated gloo group and the per-step message of engine/parallel/tp.py, in its
`pipeline` mode), each rank one stage.

Stage r holds the contiguous layers `layers_of(cfg, pp, r)` (as even as possible, the first
stages one more when the degree does not divide the layers), renumbered from 0 in its model,
and a paged cache of those layers alone. Rank 0 is the engine (scheduler, block manager,
sampler) and stage 0: it sends each step to every stage (point to point, not waited for:
`Group.posted`, so it goes on while a stage computes), embeds the tokens and runs its
layers, then sends the residual stream (T, hidden) to rank 1; each stage receives it, runs
its layers and sends it on; the last applies the final norm and sends the normed hidden
states back to rank 0, whose logits and sampling are those of one engine. The stages
compute the same sums in the same order as one engine's layers do, so their tokens and
logprobs are the single engine's exactly. With micro-batches in flight
(engine/core/micro_batches.py) rank 0's pass posts the residual stream and a receive for its
result (`Stage.defer`) and returns; `Stage.land` waits for the oldest result.

KV leaves and enters the group in the whole model's layout (`PPKVCache`): an export gathers
every stage's layers on rank 0 (concatenated along the layer dimension), an import sends each
stage its layer range, so groups of any degree and single engines exchange KV as any two
engines do. Rank 0's block manager is the group's: a block id names the same block in every
stage's cache (rank 0, holding the most layers, holds the fewest blocks). A stage that dies
makes the next send or receive fail: rank 0 raises `RankFailed`, as for a tensor-parallel rank.

Not in this slice: each stage sending its own layers' KV straight to the decode worker (rank
0 gathers them), the native one-call
decode step and layer-wise KV streaming mid-pass (a step's streams export once the pass is
through), LoRA adapters, and PP together with tensor or expert parallelism. Every stage keeps
the embedding, the final norm and the LM head (only rank 0 and the last stage use them).
"""
from __future__ import annotations

import re
import time
from collections import deque
from dataclasses import replace

import torch

from pdserve.common.errors import KVTransferError
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.kv.cache import KVCache, kv_format
from pdserve.engine.parallel.shard import span

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def check_stages(cfg: ModelConfig, pp: int) -> None:
    """Refuse a degree the model's layers cannot be split into, naming the degrees that fit."""
    if cfg.model_type == "gemma3" and pp > 1:
        raise ValueError(f"pipeline-parallel degree {pp}: a {cfg.model_type} model is not split into stages yet "
                         "(its own forward pass): use 1")
    if not 1 <= pp <= cfg.num_hidden_layers:
        raise ValueError(f"pipeline-parallel degree {pp}: this model has {cfg.num_hidden_layers} layers: use 1 to "
                         f"{cfg.num_hidden_layers}")


def layers_of(cfg: ModelConfig, pp: int, rank: int) -> range:
    """The layers stage `rank` holds."""
    s = span(cfg.num_hidden_layers, pp, rank)
    return range(s.start, s.stop)


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


def load_stage(source, config: EngineConfig, pp: int, rank: int):
    """The LoadedModel of stage `rank` (its config: the whole model's; its model: its layers,
    each keeping its index in the whole model for per-layer settings such as sliding
    windows), and the whole model's config."""
    from pdserve.engine.model.weights import LoadedModel, build_model, quantized_fingerprint

    state, cfg, fp, path = source.read()
    if config.max_model_len:
        cfg = replace(cfg, max_position_embeddings=config.max_model_len)
    check_stages(cfg, pp)
    layers = layers_of(cfg, pp, rank)
    model = build_model(cfg, stage_state(state, layers), getattr(torch, config.dtype), config.device,
                        config.packed_weights, config.quantization, layers=layers)
    return LoadedModel(model, cfg, path, quantized_fingerprint(fp, config.quantization, model)), cfg


class Stage:
    """A model's place in a pipeline (`model.pp`): where its forward pass's residual stream
    comes from and goes to."""

    def __init__(self, group):
        self.group, self.rank, self.world = group, group.rank, group.world
        self.sends = 0  # activations sent (a step's pass sends one per stage)
        self.idle_s = 0.0  # rank 0: seconds waiting for the last stage's output (the pipe's bubble)
        self.defer = False  # rank 0: a pass leaves its result in `landing` (a micro-batch in flight)
        self.landing: deque = deque()  # rank 0: (posted receive, its tensor) per micro-batch in flight
        self.broken: list = []  # rank 0: the landings of a pipe a stage broke (kept for gloo)

    def enter(self, model, input_ids: torch.Tensor) -> torch.Tensor:
        """The residual stream at this stage's first layer, (T, hidden): the embeddings on
        rank 0, else the previous stage's output."""
        if self.rank == 0:
            return model.embed(input_ids)
        dtype = model.model.embed_tokens.weight.dtype
        h = self.group.recv((input_ids.shape[0], model.config.hidden_size), dtype, self.rank - 1)
        return h.to(input_ids.device)

    def leave(self, h: torch.Tensor, delta: torch.Tensor | None, finish) -> torch.Tensor:
        """After this stage's layers: the last stage's `finish()` (the final norm, adding the
        pending `delta` of the fused path) goes back to rank 0; any other stage sends the
        residual stream h + delta on. Rank 0 returns the final normed hidden states, or, with
        `defer`, posts h and a receive for them (`land`) and returns h."""
        if self.rank == self.world - 1:
            out = finish()
            if self.rank != 0:
                self._send(out, 0)
            return out
        if delta is not None:
            h.add_(delta)  # what the next layer's fused norm would add first: the same fp32 sum
        if self.defer:  # a copy: the native path may reuse h's memory in the next pass, before it left
            self.group.isend(h.clone(), 1)
            self.sends += 1
            self.landing.append(self.group.irecv(tuple(h.shape), h.dtype, self.world - 1))
            return h
        self._send(h, self.rank + 1)
        if self.rank != 0:
            return h
        t = time.perf_counter()
        out = self.group.recv(tuple(h.shape), h.dtype, self.world - 1)
        self.idle_s += time.perf_counter() - t
        return out.to(h.device)

    def land(self, device) -> torch.Tensor:
        """Rank 0: the final normed hidden states of the oldest micro-batch in flight."""
        work, out = self.landing.popleft()
        t = time.perf_counter()
        self.group.finish(work, self.world - 1)
        self.idle_s += time.perf_counter() - t
        return out.to(device)

    def _send(self, t: torch.Tensor, dst: int) -> None:
        self.group.send(t.cpu(), dst)
        self.sends += 1


def attach_stage(model, group) -> None:
    """Make `model` (a stage's layers) one stage of `group`'s pipeline; rank 0's messages are
    posted (Group.posted) so that it can send a micro-batch's step while a stage computes another."""
    model.pp = Stage(group)
    group.posted = True


class PPKVCache(KVCache):
    """One stage's paged cache (its layers), exporting and importing in the whole model's
    layout: rank 0 gathers the stages' layers on export and sends each its layers on import
    (the other stages take part, told by rank 0's broadcast)."""

    def __init__(self, full: ModelConfig, config: EngineConfig, group):
        self.spans = [layers_of(full, group.world, r) for r in range(group.world)]
        local = replace(full, num_hidden_layers=len(self.spans[group.rank]))
        super().__init__(local, config.cache, kv_format(config.cache.kv_cache_dtype, getattr(torch, config.dtype),
                                                        config.device), config.device)
        self.full, self.group = full, group
        self.settle = None  # rank 0: lands the micro-batches in flight first (its engine's MicroBatches)

    @property
    def layout(self) -> tuple[int, ...]:
        _, two, bs, h, hd = super().layout
        return (self.full.num_hidden_layers, two, bs, h, hd)

    def _part(self, r: int, lo: int, hi: int) -> tuple[int, int]:
        """Stage r's share of the whole model's layers [lo, hi), in its own numbering."""
        s = self.spans[r]
        a, b = max(lo, s.start), min(hi, s.stop)
        return (a - s.start, max(a, b) - s.start)

    def export_blocks(self, block_ids: list[int], layers: tuple[int, int] | None = None,
                      announce: bool = True) -> torch.Tensor:
        """Rank 0: the blocks' KV of layers [start, end) (all: None) of the whole model. Always
        announced, whatever `announce` says: a pipeline's step streams its KV once the pass is
        through (runner.py), when the other stages wait for rank 0's next message."""
        g = self.group
        lo, hi = layers or (0, self.full.num_hidden_layers)
        if g.rank == 0 and self.settle is not None:  # the parts come under tag 0, as the results do
            self.settle()
        if g.rank == 0 and g.world > 1:
            g.broadcast(("export", block_ids, layers))
        mine = super().export_blocks(block_ids, self._part(g.rank, lo, hi))
        if g.rank != 0:
            g.send(mine.cpu(), 0)
            return mine
        parts = [mine]
        for r in range(1, g.world):
            a, b = self._part(r, lo, hi)
            parts.append(g.recv((b - a, 2, len(block_ids), *self.kv.shape[3:]), self.kv.dtype, r).to(mine.device))
        return torch.cat(parts)

    def import_blocks(self, block_ids: list[int], data: torch.Tensor | None) -> None:
        g = self.group
        if g.rank != 0:
            a, b = self._part(g.rank, 0, self.full.num_hidden_layers)
            part = g.recv((b - a, 2, len(block_ids), *self.kv.shape[3:]), self.kv.dtype, 0)
            return super().import_blocks(block_ids, part)
        expected = (self.full.num_hidden_layers, 2, len(block_ids), *self.kv.shape[3:])
        if tuple(data.shape) != expected or data.dtype != self.kv.dtype:  # refused before any stage is told
            raise KVTransferError(f"KV data has shape {tuple(data.shape)} and dtype {data.dtype}, expected "
                                  f"{expected} and {self.kv.dtype}")
        if self.settle is not None:
            self.settle()
        if g.world > 1:
            g.broadcast(("import", block_ids))
        for r in range(1, g.world):
            g.send(data[self.spans[r].start:self.spans[r].stop].cpu(), r)
        s = self.spans[0]
        super().import_blocks(block_ids, data[s.start:s.stop])
