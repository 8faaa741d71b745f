"""LoRA adapters over a tensor-parallel group: every rank holds its part of each resident
adapter (engine/parallel/shard.shard_lora: split as the base weights, so each layer's partial
updates are summed by the all-reduce the layer already does), under the id rank 0's registry
gave it.

Rank 0's registry (engine/core/lora_registry.py) reads its own part of each adapter through its
model's `lora_ranks` (`GroupAdapters.source`) and calls `GroupAdapters.sync` after each change of
what is resident (a load at start or at run time, an eviction, an unload): the message lists
every resident adapter (id, name, directory, digest); each other rank drops the adapters it
holds that are not listed, loads the listed ones it lacks, checks that it read the files rank 0
read (the digest), and answers whether it holds them all. Each step then carries its rows'
adapter ids (`step_groups`), which the other ranks turn back into the step's `LoRABatch`
(`RankAdapters.batch`).
"""
from __future__ import annotations

import sys

import torch

from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.model.lora import LoRAAdapter, LoRAError, load_adapter
from pdserve.engine.model.lora_batch import LoRABatch
from pdserve.engine.parallel.shard import shard_lora
from pdserve.engine.parallel.wire import PeerRefused


class LoRAGroupError(LoRAError):
    """A rank of the tensor-parallel group could not load an adapter rank 0 loaded (its error
    is on that rank's stderr): the adapter is not loaded."""


class GroupAdapters:
    """Rank 0's side, set on its model as `lora_ranks` (engine/parallel/tp.attach), where its
    registry finds it (engine/core/lora_registry.py cannot import this room)."""

    def __init__(self, group, full: ModelConfig):
        self.group, self.full = group, full

    def source(self):
        """(the config an adapter is checked against: the whole model's, `load_adapter`'s split:
        rank 0's part)."""
        world, rank = self.group.world, self.group.rank
        return self.full, lambda pairs, cfg: shard_lora(pairs, cfg, world, rank)

    def sync(self, adapters: list[LoRAAdapter]) -> None:
        """Make every other rank hold exactly `adapters` (rank 0's resident ones). Raises
        LoRAGroupError naming the ranks that could not load one."""
        group = self.group
        if group.world == 1:
            return
        group.broadcast(("lora", [[a.id, a.name, str(a.path), a.digest] for a in adapters]))
        answers = group.gather(torch.ones(1, dtype=torch.uint8))
        failed = [r for r, ok in enumerate(answers) if not int(ok[0])]
        if failed:
            raise LoRAGroupError(f"tensor-parallel ranks {failed} could not load adapter(s) "
                                 f"{', '.join(a.name for a in adapters)} (see their stderr)")


def step_groups(batch: LoRABatch | None) -> list:
    """What a step's message carries of its LoRA batch: [adapter id, rows (None: every row)]."""
    return [] if batch is None else [[a.id, rows] for a, rows in batch.groups]


class RankAdapters:
    """A rank other than 0: its parts of the resident adapters, by rank 0's ids."""

    def __init__(self, full: ModelConfig, config: EngineConfig, world: int, rank: int):
        self.full, self.config, self.world, self.rank = full, config, world, rank
        self.by_id: dict[int, LoRAAdapter] = {}

    def sync(self, group, listed: list) -> None:
        """Hold exactly the `listed` [id, name, directory, digest] adapters; answer rank 0."""
        keep = {int(i) for i, *_ in listed}
        for i in [i for i in self.by_id if i not in keep]:
            del self.by_id[i]
        ok = True
        for i, name, path, digest in listed:
            if int(i) in self.by_id:
                continue
            try:
                self.by_id[int(i)] = self._load(int(i), name, path, digest)
            except Exception as e:  # any failure is answered: rank 0 waits for every rank's answer
                print(f"pdserve tensor-parallel rank {self.rank}: adapter {name!r}: {e}", file=sys.stderr)
                ok = False
        group.gather(torch.tensor([int(ok)], dtype=torch.uint8))

    def _load(self, i: int, name: str, path: str, digest: str) -> LoRAAdapter:
        c = self.config
        adapter = load_adapter(name, path, self.full, c.lora.max_lora_rank, getattr(torch, c.dtype), c.device,
                               split=lambda pairs, cfg: shard_lora(pairs, cfg, self.world, self.rank))
        if adapter.digest != digest:
            raise LoRAError(f"{path}: the files changed between rank 0's load and this rank's")
        adapter.id = i
        return adapter

    def batch(self, groups: list) -> LoRABatch | None:
        """The step's LoRA batch from its message's `step_groups`."""
        if not groups:
            return None
        missing = [int(i) for i, _ in groups if int(i) not in self.by_id]
        if missing:
            raise PeerRefused(f"a step names adapter ids {missing} that rank {self.rank} does not hold")
        return LoRABatch([(self.by_id[int(i)], rows) for i, rows in groups])
