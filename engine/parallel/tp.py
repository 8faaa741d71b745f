"""Tensor parallelism on one host: an engine whose model is split over N ranks (processes)
that talk through `torch.distributed` (gloo on the CPU).

Each rank holds a slice of every layer, Megatron-style: q/k/v and gate/up are split by output
(attention heads with their KV heads; the MLP's intermediate units), o_proj and down_proj by
input, and their partial outputs are summed by an all-reduce, so each layer costs two. KV
heads are split with their query heads; a degree above the KV head count replicates each KV
head on the ranks of its query group. The embedding and the LM head are split by vocabulary
rows: a lookup is summed over the group (each id lives on one rank), and each rank's logits
are gathered on rank 0, the only rank that samples. Norms are replicated. Each rank's paged
cache holds its KV heads of every block.

Rank 0 is the engine: its scheduler and block manager decide everything, and before each
forward pass it broadcasts the step (token ids, positions, the attention metadata) to the
other ranks, which run their slice on their own cache. KV leaves and enters the group in the
whole model's layout (`TPKVCache`): an export gathers every rank's heads, an import scatters
them, so groups of different degrees exchange KV as any two engines do. A rank that dies
makes the next collective fail: rank 0 raises `RankFailed` and the ranks left exit. LoRA
adapters are split as the base weights; each rank holds its part of every adapter rank 0
holds, and each step names its rows' adapters (engine/parallel/lora.py).

In `expert` mode the same group runs expert parallelism instead (engine/parallel/ep.py): each
rank holds the whole model but for its share of the experts, and its cache every KV head. In
`pipeline` mode it runs pipeline parallelism (engine/parallel/pp.py): each stage holds its
contiguous range of the layers, and the residual stream moves stage to stage; a stage is one
rank, or with `EngineConfig.tensor_parallel_size` > 1 a tensor-parallel group of that many
(PP x TP: a stage group of its own beside the pipeline's, pp.stage_group), or with
`EngineConfig.expert_parallel_size` > 1 an expert-parallel group of that many (PP x EP: the
stage's experts split over its ranks, its attention whole on each).

The group is rank 0's process and the ranks it starts, and no one else: each group has a
random secret that rank 0 hands its ranks on their stdin; the rendezvous, the ranks' proofs
of the secret and rank 0's sealed, unpickled messages are in engine/parallel/group.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace

import torch

from pdserve.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.engine.kv.cache import KVCache
from pdserve.engine.parallel.ep import EPKVCache, attach_experts, check_experts, shard_experts
from pdserve.engine.parallel.group import JOIN_S, Group, RankFailed, announce_loaded, await_loaded, group_store
from pdserve.engine.parallel.lora import GroupAdapters, RankAdapters, step_groups
from pdserve.engine.parallel.pp import PPKVCache, attach_stage, load_stage, stage_group, stage_width
from pdserve.engine.parallel.pp_handoff import COMMANDS as HANDOFF_COMMANDS
from pdserve.engine.parallel.shard import check_degree, kv_heads_of, shard, vocab_of
from pdserve.engine.parallel.wire import PeerRefused, group_secret


@dataclass(frozen=True)
class ModelSource:
    """Where every rank reads the whole model's weights from: a model path (as EngineConfig.model)
    or, for tests, the tiny random Llama of `tiny_seed`."""

    model: str = ""
    tiny_seed: int | None = None
    tiny_overrides: tuple[tuple[str, object], ...] = ()
    """(field, value) pairs of the tiny model's config (engine/tiny.tiny_config)."""

    def read(self):
        """(state dict, config, fingerprint, path)."""
        from pathlib import Path

        from pdserve.engine.model.weights import load_state_dict, resolve_model_path
        if self.tiny_seed is not None:
            from pdserve.engine.model.tiny import tiny_config, tiny_state_dict
            cfg = tiny_config(**dict(self.tiny_overrides))
            return tiny_state_dict(cfg, self.tiny_seed), cfg, f"tiny-{self.tiny_seed}", Path("<tiny>")
        path = resolve_model_path(self.model or None)
        state, cfg, fp = load_state_dict(path)
        return state, cfg, fp, path


def load_rank(source: ModelSource, config: EngineConfig, tp: int, rank: int, expert: bool = False,
              pipeline: bool = False):
    """The LoadedModel of one rank's slice (its config: the slice's heads and units, the
    whole vocabulary; `expert`: the whole model's, its share of the experts; `pipeline`: the
    whole model's, its stage's layers: pp.load_stage), and the whole model's config."""
    from pdserve.engine.model.weights import LoadedModel, build_cached, build_model, quantized_fingerprint

    if pipeline:
        return load_stage(source, config, tp, rank)
    state, cfg, fp, path = source.read()
    if config.max_model_len:
        cfg = replace(cfg, max_position_embeddings=config.max_model_len)
    if expert:
        part, share = shard_experts(state, cfg, tp, rank)
        model = build_model(cfg, part, getattr(torch, config.dtype), config.device, config.packed_weights,
                            config.quantization, experts=share)
        return LoadedModel(model, cfg, path, quantized_fingerprint(fp, config.quantization, model)), cfg
    local_state, local = shard(state, cfg, tp, rank)
    model = build_cached(path, local, local_state, getattr(torch, config.dtype), config.device, config.packed_weights,
                         config.quantization, part=f"tp{tp}r{rank}")
    return LoadedModel(model, replace(local, vocab_size=cfg.vocab_size), path,
                       quantized_fingerprint(fp, config.quantization, model)), cfg


def attach(model, group: Group, full: ModelConfig, expert: bool = False, pipeline: bool = False,
           stage_tp: Group | None = None) -> None:
    """Sum every layer's partial attention and MLP outputs, and the embedding lookups, over
    the group; gather the logits of every rank's vocabulary rows. `expert`: sum only the MoE
    layers' outputs (ep.attach_experts); `pipeline`: make the model a stage (pp.attach_stage),
    its layers' sums over `stage_tp` (its stage's group; None: a stage of one rank)."""
    if pipeline:
        return attach_stage(model, group, stage_tp)
    if expert:
        return attach_experts(model, group)
    for layer in model.model.layers:
        layer.self_attn.tp = layer.mlp.tp = group
    spans = [vocab_of(full, group.world, r) for r in range(group.world)]
    group.widths = [v.stop - v.start for v in spans]
    model.tp, model.vocab_start = group, spans[group.rank].start
    model.lora_ranks = GroupAdapters(group, full)  # rank 0's LoRA registry keeps the ranks' adapters with it


def _die_with_parent() -> None:
    """Exit when rank 0's process goes, however it goes (checked every second: a parent-death
    signal would fire when the thread that started this rank exits, which loaders do)."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)
    threading.Thread(target=watch, daemon=True, name="pdserve-tp-parent-watch").start()


def rank_args(source: ModelSource, config: EngineConfig, tp: int, rank: int, port: int, timeout_s: float,
              threads: int, secret: bytes, expert: bool = False, pipeline: bool = False) -> bytes:
    """A rank's arguments as the JSON its process reads on stdin (`follower_entry`)."""
    return json.dumps({"source": asdict(source), "config": asdict(config), "tp": tp, "rank": rank, "port": port,
                       "timeout_s": timeout_s, "threads": threads, "secret": secret.hex(), "expert": expert,
                       "pipeline": pipeline}).encode()


def follower_entry() -> None:
    """A rank's process: its arguments, the group's secret among them, come as JSON on stdin
    (a pipe from rank 0's process: no other process sees the secret)."""
    a = json.loads(sys.stdin.buffer.read())
    src, cfg = a["source"], a["config"]
    source = ModelSource(src["model"], src["tiny_seed"], tuple((k, v) for k, v in src["tiny_overrides"]))
    config = EngineConfig(**(cfg | {"cache": CacheConfig(**cfg["cache"]),
                                    "scheduler": SchedulerConfig(**cfg["scheduler"])}))
    follower_main(source, config, a["tp"], a["rank"], a["port"], a["timeout_s"], a["threads"],
                  bytes.fromhex(a["secret"]), a["expert"], a["pipeline"])


def follower_main(source: ModelSource, config: EngineConfig, tp: int, rank: int, port: int, timeout_s: float,
                  threads: int, secret: bytes, expert: bool = False, pipeline: bool = False) -> None:
    """A rank other than 0: build its slice and cache, then run the steps rank 0 sends."""
    _die_with_parent()
    torch.set_num_threads(max(1, threads))
    from pdserve.engine.kernels.attention import default_backend
    loaded, full = load_rank(source, config, tp, rank, expert, pipeline)
    _, store = group_store("127.0.0.1", port, tp, False, timeout_s, secret)
    try:
        announce_loaded(store, rank)
        group = Group(rank, tp, store, timeout_s, secret)
        stage_tp = stage_group(store, rank, stage_width(config, tp), timeout_s, secret) if pipeline else None
    except (RankFailed, PeerRefused) as e:
        print(f"pdserve tensor-parallel rank {rank}: {e}", file=sys.stderr)
        os._exit(1)
    attach(loaded.model, group, full, expert, pipeline, stage_tp)
    w8 = loaded.model.int8_activation_matrices() > 0  # the K/V format "auto" picks (kv_format), as rank 0's
    kv = PPKVCache(full, config, group, w8) if pipeline else EPKVCache(full, config, group, w8) if expert \
        else TPKVCache(full, loaded.config, config, group, w8)
    model = loaded.model
    model.backend = default_backend(config.device, getattr(torch, config.dtype), config.attention)
    model.use_native_ops(_native_ok(model))
    layers = kv.layers()
    adapters = RankAdapters(full, config, tp, rank)
    try:
        with torch.inference_mode():
            while True:
                cmd = group.receive(config.device)
                if cmd[0] == "step":
                    _follow_step(model, kv, layers, adapters, *cmd[1:])
                elif cmd[0] == "lora":
                    adapters.sync(group, cmd[1])
                elif cmd[0] == "export":
                    kv.export_blocks(*cmd[1:])
                elif cmd[0] == "import":
                    kv.import_blocks(cmd[1], None)
                elif cmd[0] == "experts":  # a pipeline's expert load, for rank 0's /metrics
                    kv.send_expert_tokens(model)
                elif pipeline and cmd[0] in HANDOFF_COMMANDS:  # each rank's own part of a hand-off
                    getattr(kv, cmd[0])(*cmd[1:])
                elif cmd[0] == "stop":
                    return
    except (RankFailed, PeerRefused):
        os._exit(1)  # rank 0 is gone, or what came was not from it: nothing left to serve
    finally:
        group.close()
        if stage_tp is not None:
            stage_tp.close()
        if getattr(kv, "endpoint", None) is not None:
            kv.endpoint.stop()


def layer_streams(streams: list[tuple[list[int], int]], n_layers: int, export):
    """The per-layer callback of a step that streams KV: for the k-th (blocks, group) of
    `streams`, `export(k, blocks, (start, end))` once layers [start, end) are written, every
    `group` layers and at the last one. The same on every rank: each export is a gather."""
    def after_layer(i: int) -> None:
        for k, (blocks, group) in enumerate(streams):
            if (i + 1) % group == 0 or i + 1 == n_layers:
                export(k, blocks, (i - i % group, i + 1))
    return after_layer


def _follow_step(model, kv: "TPKVCache", layers, adapters: RankAdapters, ids, pos, meta, passes, sampled, streams,
                 lora) -> None:
    """Rank 0's step on this rank's slice: the forward pass (its rows under their adapters, this
    rank's parts of them) with its KV exports, then the same logits passes (their results live
    on rank 0; none on an expert-parallel rank, whose model holds the whole vocabulary: there
    is no gather to join)."""
    model.backend.prepare(meta)
    after = None
    if streams:
        after = layer_streams(streams, len(layers), lambda _, b, r: kv.export_blocks(b, r, announce=False))
    batch = adapters.batch(lora)
    if batch is None:
        hidden = model(ids, pos, layers, meta, after)
    else:
        hidden = model(ids, pos, layers, meta, after, lora=batch)
    if model.tp is None:
        return
    for lo, hi in passes:
        model.compute_logits(hidden[lo:hi])
    model.compute_logits(hidden if sampled is None else hidden[sampled])


def _native_ok(model) -> bool:
    from pdserve.engine.kernels.attention import NativeAttentionBackend
    fused = getattr(model.model.layers[0].mlp, "gate_up_weight", None) is not None
    return isinstance(model.backend, NativeAttentionBackend) and fused


class TPKVCache(KVCache):
    """One rank's paged cache (its KV heads), exporting and importing in the whole model's
    layout: rank 0 gathers the other ranks' heads on export and scatters them on import
    (the other ranks take part in the same calls, told by rank 0's broadcast)."""

    def __init__(self, full: ModelConfig, local: ModelConfig, config: EngineConfig, group: Group,
                 int8_activations: bool = False):
        from pdserve.engine.kv.cache import kv_format
        super().__init__(local, config.cache, kv_format(config.cache.kv_cache_dtype, getattr(torch, config.dtype),
                                                        config.device, int8_activations), config.device)
        self.full, self.group = full, group
        tp, kv = group.world, full.num_key_value_heads
        # the ranks whose heads make up the whole model's (one per KV head group when replicated)
        self.owners = list(range(tp)) if tp <= kv else list(range(0, tp, tp // kv))

    @property
    def layout(self) -> tuple[int, ...]:
        L, two, bs, _, hd = super().layout
        return (L, two, bs, self.full.num_key_value_heads, hd)

    def export_blocks(self, block_ids: list[int], layers: tuple[int, int] | None = None,
                      announce: bool = True) -> torch.Tensor:
        """`announce` False: the other ranks export the same blocks without being told (inside
        a forward pass, from the step's layer streams)."""
        g = self.group
        if g.rank == 0 and g.world > 1 and announce:
            g.broadcast(("export", block_ids, layers))
        mine = super().export_blocks(block_ids, layers)
        parts = g.gather(mine)
        if g.rank != 0:
            return mine
        return torch.cat([parts[r] for r in self.owners], dim=4)

    def import_blocks(self, block_ids: list[int], data: torch.Tensor | None) -> None:
        g = self.group
        if g.rank == 0:
            expected = (self.kv.shape[0], 2, len(block_ids), self.block_size, self.full.num_key_value_heads,
                        self.kv.shape[-1])
            if tuple(data.shape) != expected:
                from pdserve.common.errors import KVTransferError
                raise KVTransferError(f"KV data has shape {tuple(data.shape)}, expected {expected}")
            g.broadcast(("import", block_ids))
            parts = [data[:, :, :, :, kv_heads_of(self.full, g.world, r)].contiguous().cpu() for r in range(g.world)]
        mine = torch.empty(self.kv.shape[0], 2, len(block_ids), *self.kv.shape[3:], dtype=self.kv.dtype)
        g.scatter(parts if g.rank == 0 else None, mine)
        super().import_blocks(block_ids, mine)


class TensorParallel:
    """Rank 0's side of a group: starts the other ranks, owns the collectives; `loaded` is its
    own slice, `kv_cache(config)` its cache. `stop()` ends the group. `expert`: an
    expert-parallel group of `tp` ranks (engine/parallel/ep.py); `pipeline`: a pipeline of `tp`
    ranks (engine/parallel/pp.py) in `stages` stages of `config.tensor_parallel_size` ranks each
    (PP x TP; 1: a stage a rank) or of `config.expert_parallel_size` (PP x EP, whether or not
    `expert` says so too), `stage_tp` rank 0's stage group. `timeout_s`: the collectives' and
    the rendezvous' timeout; `join_s`: how long the other ranks may take to start and load
    their slices (one that exits fails the start at once)."""

    def __init__(self, source: ModelSource, config: EngineConfig, tp: int, timeout_s: float = 60.0,
                 threads_per_rank: int = 0, expert: bool = False, pipeline: bool = False, join_s: float = JOIN_S):
        self.tp, self.config, self.expert, self.pipeline = tp, config, expert, pipeline
        self.stages = tp // stage_width(config, tp) if pipeline else 1
        kind = "a pipeline-parallel group" if pipeline else "an expert-parallel group" if expert else ""
        if kind and config.lora.max_loras:
            raise ValueError(f"LoRA adapters on {kind} are not supported yet: use --max-loras 0 or degree 1")
        self.loaded, self.full = load_rank(source, config, tp, 0, expert, pipeline)
        if not pipeline:  # a pipeline's degree is checked before its stage is built (pp.check_stages)
            (check_experts if expert else check_degree)(self.full, tp)
        secret = group_secret()
        self._store, store = group_store("127.0.0.1", 0, tp, True, timeout_s, secret)
        port = self._store.port
        # the CPUs the worker was given (its engine's threads), else the host's, shared by the ranks
        self.threads = threads = threads_per_rank or max(1, (config.num_threads or os.cpu_count() or 1) // tp)
        # fresh interpreters (not multiprocessing): nothing depends on how the parent's main module
        # was started (a console script, a Ray worker, a test runner)
        self.procs = []
        for r in range(1, tp):
            p = subprocess.Popen([sys.executable, "-c", "from pdserve.engine.parallel.tp import follower_entry; follower_entry()"],
                                 stdin=subprocess.PIPE)
            p.stdin.write(rank_args(source, config, tp, r, port, timeout_s, threads, secret, expert, pipeline))
            p.stdin.close()
            self.procs.append(p)
        self.stage_tp = None
        try:
            await_loaded(store, self.procs, join_s)
            self.group = Group(0, tp, store, timeout_s, secret, on_failure=self._kill_ranks)
            if pipeline:
                self.stage_tp = stage_group(store, 0, tp // self.stages, timeout_s, secret, self._kill_ranks)
        except (RankFailed, PeerRefused):
            self._kill_ranks()
            raise
        attach(self.loaded.model, self.group, self.full, expert, pipeline, self.stage_tp)

    def kv_cache(self) -> TPKVCache | EPKVCache | PPKVCache:
        w8 = self.loaded.model.int8_activation_matrices() > 0  # the K/V format "auto" picks (kv_format)
        if self.pipeline:
            return PPKVCache(self.full, self.config, self.group, w8)
        if self.expert:
            return EPKVCache(self.full, self.config, self.group, w8)
        return TPKVCache(self.full, self.loaded.config, self.config, self.group, w8)

    def step(self, input_ids: torch.Tensor, positions: torch.Tensor, meta, passes: list[tuple[int, int]],
             sampled: list[int] | None, streams: list | None = None, lora=None) -> None:
        """Before rank 0's forward pass: the other ranks run the same step, with the same
        prompt-logprob row ranges `passes`, then the sampled rows (`sampled`; None: all), the
        KV exports of `streams` ((blocks, every n layers)) inside it, and the rows of each
        adapter of `lora` (the step's LoRABatch, None: all rows on the base) under their parts of it.
        An expert-parallel group's other ranks export no KV (rank 0's is the group's), nor do a
        pipeline's mid-pass (rank 0 exports once the pass is through, runner.py)."""
        if self.tp > 1:
            streams = [] if self.expert or self.pipeline else streams or []
            self.group.broadcast(("step", input_ids, positions, meta, passes, sampled, streams, step_groups(lora)))

    def dead_ranks(self) -> list[int]:
        """The ranks whose processes have exited (the group cannot step any more)."""
        return [r for r, p in enumerate(self.procs, 1) if p.poll() is not None]

    def _kill_ranks(self) -> None:
        """A rank failed: the others stop at once (not at their collective's timeout)."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()

    def stop(self) -> None:
        try:
            if self.tp > 1 and all(p.poll() is None for p in self.procs):
                self.group.broadcast(("stop",))
        except RankFailed:
            pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.group.close()
        if self.stage_tp is not None:
            self.stage_tp.close()
