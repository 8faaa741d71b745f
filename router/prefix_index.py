"""Global prefix index: which worker holds which KV blocks, followed from KV events.

Each worker numbers its events 1, 2, 3, ...; the index applies them in order and notices a
gap (a lost or reordered event). A worker with a gap is marked for resync: its entries are
distrusted until a snapshot of its cached hashes replaces them (`reset_worker`).
Pure Python; the router feeds it from Redis Streams.
"""
from __future__ import annotations

from collections import defaultdict

from engine.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


class PrefixIndex:
    def __init__(self):
        self._holders: dict[int, set[str]] = defaultdict(set)  # block hash -> workers
        self._blocks: dict[str, set[int]] = defaultdict(set)   # worker -> block hashes
        self._seq: dict[str, int] = {}
        self.needs_resync: set[str] = set()

    def apply(self, worker_id: str, event: KVEvent) -> bool:
        """Apply one event. Returns False (and marks the worker for resync) on a gap."""
        last = self._seq.get(worker_id, 0)
        if event.seq <= last:
            return True  # a duplicate delivery: already applied
        if event.seq != last + 1 or worker_id in self.needs_resync:
            self.needs_resync.add(worker_id)
            return False
        self._seq[worker_id] = event.seq
        if isinstance(event, BlockStored):
            self._holders[event.block_hash].add(worker_id)
            self._blocks[worker_id].add(event.block_hash)
        elif isinstance(event, BlockRemoved):
            self._drop(worker_id, event.block_hash)
        elif isinstance(event, AllBlocksCleared):
            self._clear(worker_id)
        return True

    def reset_worker(self, worker_id: str, block_hashes, seq: int) -> None:
        """Replace a worker's entries with a snapshot taken at event number `seq`."""
        self._clear(worker_id)
        for h in block_hashes:
            self._holders[h].add(worker_id)
            self._blocks[worker_id].add(h)
        self._seq[worker_id] = seq
        self.needs_resync.discard(worker_id)

    def remove_worker(self, worker_id: str) -> None:
        self._clear(worker_id)
        self._seq.pop(worker_id, None)
        self.needs_resync.discard(worker_id)

    def match(self, block_hashes: list[int]) -> dict[str, int]:
        """For each worker in sync, how many leading blocks of the prompt it holds."""
        counts: dict[str, int] = {}
        alive = set(self._blocks) - self.needs_resync
        for i, h in enumerate(block_hashes):
            alive &= self._holders.get(h, set())
            if not alive:
                break
            for w in alive:
                counts[w] = i + 1
        return counts

    def num_blocks(self, worker_id: str) -> int:
        return len(self._blocks.get(worker_id, ()))

    def _drop(self, worker_id: str, h: int) -> None:
        self._blocks[worker_id].discard(h)
        holders = self._holders.get(h)
        if holders is not None:
            holders.discard(worker_id)
            if not holders:
                del self._holders[h]

    def _clear(self, worker_id: str) -> None:
        for h in list(self._blocks.get(worker_id, ())):
            self._drop(worker_id, h)
        self._blocks.pop(worker_id, None)
