"""Global prefix index: which worker holds which KV blocks, followed from KV events.

Each worker numbers its events 1, 2, 3, ...; the index applies them in order and notices a
gap (a lost or reordered event). A worker with a gap is marked for resync: its entries are
distrusted until a snapshot of its cached hashes replaces them (`reset_worker`).
Pure Python; the router feeds it from Redis Streams.

A worker also reports the blocks it keeps in the tiers under its pool (events of tier "host"
or "disk"): `match` counts them too, each at its tier's weight (`TIER_WEIGHTS`: copying a
block back is cheaper than computing it, dearer than having it in the pool).

Events arrive after the prefill that caused them, so the router also records where it just
sent a prompt (`expect`): until that worker's events confirm the blocks, or a deadline passes,
they count as held there. Without it, the prompts of one new prefix that arrive before the
first one's events scatter over the workers, each computing and caching its own copy.

For peer prefix pulls, `holders` scores each worker by what its events say it holds now (not
what is only expected there: a pull needs the blocks to exist): the prompt's leading blocks
and their worth at the same tier weights (a pull from a peer's disk tier costs it a read).
"""
from __future__ import annotations

import time
from collections import defaultdict, deque

from pdserve.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


TIER_WEIGHTS = {"device": 1.0, "host": 0.9, "disk": 0.5}
"""What a block held in each place is worth to a prompt, in blocks it need not compute."""


class PrefixIndex:
    def __init__(self):
        self._holders: dict[int, set[str]] = defaultdict(set)  # block hash -> workers
        self._blocks: dict[str, set[int]] = defaultdict(set)   # worker -> block hashes
        self._lower: dict[int, dict[str, set[str]]] = defaultdict(dict)  # hash -> worker -> its lower tiers
        self._lower_blocks: dict[str, set[int]] = defaultdict(set)  # worker -> hashes it keeps in a tier
        self._seq: dict[str, int] = {}
        self.needs_resync: set[str] = set()
        # hash -> worker -> deadlines, one per prompt in flight that expects it there
        self._expected: dict[int, dict[str, list[float]]] = defaultdict(dict)
        self._expiry: deque[tuple[float, str, int]] = deque()  # (deadline, worker, hash), oldest first
        self._expecting: dict[str, int] = defaultdict(int)  # worker -> its expected blocks

    def apply(self, worker_id: str, event: KVEvent) -> bool:
        """Apply one event. Returns False (and marks the worker for resync) on a gap."""
        last = self._seq.get(worker_id, 0)
        if event.seq <= last:
            return True  # a duplicate delivery: already applied
        if event.seq != last + 1 or worker_id in self.needs_resync:
            self.needs_resync.add(worker_id)
            return False
        self._seq[worker_id] = event.seq
        if getattr(event, "tier", "device") != "device":
            self._apply_tier(worker_id, event)
        elif isinstance(event, BlockStored):
            self._holders[event.block_hash].add(worker_id)
            self._blocks[worker_id].add(event.block_hash)
            self._unexpect(worker_id, event.block_hash)  # confirmed: the event stands for it now
        elif isinstance(event, BlockRemoved):
            self._drop(worker_id, event.block_hash)
        elif isinstance(event, AllBlocksCleared):
            self._clear(worker_id)
        return True

    def _apply_tier(self, worker_id: str, event: KVEvent) -> None:
        tiers = self._lower[event.block_hash].setdefault(worker_id, set())
        if isinstance(event, BlockStored):
            tiers.add(event.tier)
            self._lower_blocks[worker_id].add(event.block_hash)
            return
        tiers.discard(event.tier)
        if not tiers:
            self._drop_lower(worker_id, event.block_hash)

    def _drop_lower(self, worker_id: str, h: int) -> None:
        held = self._lower.get(h)
        if held is not None:
            held.pop(worker_id, None)
            if not held:
                del self._lower[h]
        self._lower_blocks[worker_id].discard(h)

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

    def expect(self, worker_id: str, block_hashes: list[int], ttl_s: float = 10.0,
               now: float | None = None) -> float:
        """`worker_id` was just sent a prompt with these blocks: count them as held there until
        its events confirm them or `ttl_s` passes (a prefill that failed or never ran).
        Returns the deadline, which names this expectation for `withdraw`."""
        now = time.monotonic() if now is None else now
        self._expire(now)
        deadline = now + ttl_s
        for h in block_hashes:
            if worker_id not in self._holders.get(h, ()):
                deadlines = self._expected[h].setdefault(worker_id, [])
                if not deadlines:
                    self._expecting[worker_id] += 1
                deadlines.append(deadline)
                self._expiry.append((deadline, worker_id, h))
        return deadline

    def withdraw(self, worker_id: str, block_hashes: list[int], deadline: float) -> None:
        """The prompt `expect` announced with `deadline` will not be computed there after all
        (the decode worker prefilled it itself, or the request failed or moved): drop its
        expectation. Other prompts in flight that expect the same blocks there keep theirs."""
        for h in block_hashes:
            self._forget(worker_id, h, deadline)

    def match(self, block_hashes: list[int], now: float | None = None) -> dict[str, float]:
        """For each worker in sync, the leading blocks of the prompt it holds (or is expected
        to hold: see `expect`), in its pool or in a tier under it, each counted at its
        place's weight (`TIER_WEIGHTS`; 1 each when all are in the pool)."""
        now = time.monotonic() if now is None else now
        counts: dict[str, float] = {}
        alive = ({w for w, blocks in self._blocks.items() if blocks} | set(self._expecting)
                 | {w for w, blocks in self._lower_blocks.items() if blocks})
        alive -= self.needs_resync
        for h in block_hashes:
            expected = self._expected.get(h)
            held = self._holders.get(h, set())
            if expected:
                held = held | {w for w, deadlines in expected.items() if max(deadlines) > now}
            lower = self._lower.get(h, {})
            alive &= held | lower.keys()
            if not alive:
                break
            for w in alive:
                weight = 1.0 if w in held else max(TIER_WEIGHTS[t] for t in lower[w])
                counts[w] = counts.get(w, 0.0) + weight
        return counts

    def holders(self, block_hashes: list[int]) -> dict[str, tuple[int, float]]:
        """For each worker in sync: how many of the prompt's leading blocks its events say it
        holds (in its pool or a tier under it), and their worth at `TIER_WEIGHTS`."""
        out: dict[str, tuple[int, float]] = {}
        alive: set[str] | None = None
        for h in block_hashes:
            pool, lower = self._holders.get(h, set()), self._lower.get(h, {})
            here = (pool | lower.keys()) - self.needs_resync
            alive = here if alive is None else alive & here
            if not alive:
                break
            for w in alive:
                n, worth = out.get(w, (0, 0.0))
                out[w] = (n + 1, worth + (1.0 if w in pool else max(TIER_WEIGHTS[t] for t in lower[w])))
        return out

    def num_blocks(self, worker_id: str) -> int:
        return len(self._blocks.get(worker_id, ()))

    def _forget(self, worker_id: str, h: int, deadline: float) -> None:
        """One prompt's expectation of block `h` there ends (withdrawn or past its deadline)."""
        deadlines = self._expected.get(h, {}).get(worker_id)
        if deadlines and deadline in deadlines:
            deadlines.remove(deadline)
            if not deadlines:
                self._unexpect(worker_id, h)

    def _unexpect(self, worker_id: str, h: int) -> None:
        """All expectations of block `h` there end (its event confirmed it, or the worker left)."""
        expected = self._expected.get(h)
        if expected is not None and expected.pop(worker_id, None) is not None:
            self._expecting[worker_id] -= 1
            if not self._expecting[worker_id]:
                del self._expecting[worker_id]
            if not expected:
                del self._expected[h]

    def _expire(self, now: float) -> None:
        while self._expiry and self._expiry[0][0] <= now:
            deadline, w, h = self._expiry.popleft()
            self._forget(w, h, deadline)  # a no-op if it was withdrawn or confirmed meanwhile

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
        for h in list(self._lower_blocks.get(worker_id, ())):
            self._drop_lower(worker_id, h)
        self._lower_blocks.pop(worker_id, None)
        if worker_id in self._expecting:
            for _, w, h in self._expiry:
                if w == worker_id:
                    self._unexpect(w, h)
