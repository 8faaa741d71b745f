"""Block manager: which KV blocks each request owns, which hold reusable prefix content.

Pure Python, no tensors. Every block is in exactly one of two states:
- in use: ref_count > 0, listed in the block tables of ref_count requests;
- free: ref_count == 0, in the free queue. A free block may still be *cached* (it has a
  content hash and the KV it holds is valid); a later request with the same prefix takes it
  back out of the queue instead of recomputing. The free queue is LRU: allocation pops the
  head (least recently freed) and only then evicts its cached content.

Below the pool, optional tiers (engine/kv/tiers.py, set as `tiers`) keep evicted cached blocks;
a prefix match that continues there copies them back. The manager itself stays tensor-free.

Requests free their blocks tail-first so that, among blocks freed together, a sequence's
unique tail is evicted before the shared prefix at its head.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from pdserve.common.block_hash import ROOT_HASH, hash_block
from pdserve.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventListener, KVEvent


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None


@dataclass(frozen=True)
class PrefixMatch:
    """Cached blocks that hold a prompt's prefix (a lookup result; nothing is taken yet)."""

    block_ids: tuple[int, ...] = ()
    hashes: tuple[int, ...] = ()
    num_tokens: int = 0


@dataclass
class _Owned:
    blocks: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # hashes of blocks[0:len(hashes)]


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 namespace: str = "", listener: EventListener | None = None):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.namespace = namespace
        self.listener = listener
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._owned: dict[str, _Owned] = {}
        self._event_seq = 0
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0     # tokens found cached (in the pool or copied back from a tier)
        self._tiers = None  # engine/kv/tiers.py TieredStore: where evicted cached blocks go
        self.tier_hits: dict[str, int] = {}  # tier -> tokens copied back from it
        self.admit_tokens = 0  # the scheduler's step budget: a request starts with one chunk

    @property
    def tiers(self):
        return self._tiers

    @tiers.setter
    def tiers(self, store) -> None:
        """Put `store` (or None) under the pool; its changes become KV events of their tier."""
        self._tiers = store
        if store is not None:
            store.on_change = self._tier_event

    def _tier_event(self, h: int, tier: str, held: bool) -> None:
        if held:
            self._emit(lambda s: BlockStored(s, h, 0, (), -1, tier))
        else:
            self._emit(lambda s: BlockRemoved(s, h, -1, tier))

    # ---- accounting -------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def block_table(self, req_id: str) -> list[int]:
        owned = self._owned.get(req_id)
        return list(owned.blocks) if owned else []

    def owners(self) -> list[str]:
        return list(self._owned)

    def cached_block(self, h: int) -> int | None:
        """The pool block caching hash `h` (in use or free), or None."""
        return self._cached.get(h)

    # ---- prefix cache -----------------------------------------------------------------
    def match_prefix(self, token_ids: list[int], count: bool = True, root: int = ROOT_HASH,
                     whole: bool = False) -> PrefixMatch:
        """Longest run of cached full blocks at the start of `token_ids`. At least one token
        is always left to compute (the model must produce logits for the last one).
        count=False: a look only, not counted in the hit-rate statistics. `root`: the first
        block's parent hash (`block_hash.root_hash` of the request's cache salt). Where the run
        continues in a lower tier (`tiers`), those blocks are copied back into free blocks
        first (`_restore`), cached again, and part of the match, if the request can start now
        (`_fits`); `whole`: it starts only with blocks for its whole prompt (a KV import)."""
        if not self.enable_caching:
            return PrefixMatch()
        bs = self.block_size
        max_blocks = (len(token_ids) - 1) // bs
        ids, hashes, parent = [], [], root
        for b in range(max_blocks):
            chunk = token_ids[b * bs:(b + 1) * bs]
            h = hash_block(parent, chunk, self.namespace)
            bid = self._cached.get(h)
            if bid is None and self.tiers is not None and self.tiers.has(h) and self._fits(token_ids, ids, whole):
                bid = self._restore(h, parent, chunk, ids)
            if bid is None:
                break
            ids.append(bid)
            hashes.append(h)
            parent = h
        if count:
            self.count_prefix(len(token_ids), len(ids) * bs)
        return PrefixMatch(tuple(ids), tuple(hashes), len(ids) * bs)

    def count_prefix(self, num_tokens: int, hit_tokens: int) -> None:
        """Count one prompt's lookup in the hit-rate statistics: `num_tokens` looked up,
        `hit_tokens` of them found (the scheduler counts a request once, when it is admitted,
        not at every step it waits)."""
        self.prefix_queries += num_tokens
        self.prefix_hits += hit_tokens

    def _fits(self, token_ids: list[int], ids: list[int], whole: bool = False) -> bool:
        """Whether the request can start now with its prefix copied back: the free queue
        holds this block, and then its first chunk's (`admit_tokens`; 0 or `whole`: the whole
        prompt's). A request that cannot start would otherwise copy its prefix back at every
        step (or every retry of a KV import), and running requests evict it again in between."""
        reuse = sum(1 for bid in ids if self.blocks[bid].ref_count == 0)
        rest = -(-len(token_ids) // self.block_size) - len(ids)
        if self.admit_tokens and not whole:
            rest = min(rest, 1 + -(-self.admit_tokens // self.block_size))
        return len(self._free) - reuse >= rest

    def _restore(self, h: int, parent: int, chunk: list[int], keep: list[int]) -> int | None:
        """A free block holding the lower tiers' KV of hash `h`, cached again and last in the
        free queue (so the allocation that follows the match takes it, not another one), or
        None. The block taken is the least recently freed one outside `keep` (the match so
        far); its own cached content goes down a tier as any eviction's does."""
        bid = next((b for b in self._free if b not in keep), None)
        if bid is None:
            return None
        self._evict(bid)
        tier = self.tiers.load(h, bid)
        if tier is None:
            return None
        self.tier_hits[tier] = self.tier_hits.get(tier, 0) + self.block_size
        self.blocks[bid].block_hash = h
        self._cached[h] = bid
        self._free.move_to_end(bid)
        self._emit(lambda s: BlockStored(s, h, parent, tuple(chunk), bid))
        return bid

    # ---- allocation -------------------------------------------------------------------
    def blocks_needed(self, req_id: str, num_tokens: int, prefix: PrefixMatch | None = None) -> int:
        """Free-queue blocks an `allocate(req_id, num_tokens, prefix)` would consume."""
        owned = self._owned.get(req_id)
        have = len(owned.blocks) if owned else 0
        reuse = 0
        if prefix and not have:
            have = len(prefix.block_ids)
            reuse = sum(1 for b in prefix.block_ids if self.blocks[b].ref_count == 0)
        return max(0, -(-num_tokens // self.block_size) - have) + reuse

    def allocate(self, req_id: str, num_tokens: int, prefix: PrefixMatch | None = None) -> bool:
        """Grow `req_id`'s block table to hold `num_tokens` tokens; on its first allocation,
        take `prefix`'s cached blocks first. Returns False (changing nothing) if the free
        queue is too short."""
        if self.blocks_needed(req_id, num_tokens, prefix) > len(self._free):
            return False
        owned = self._owned.get(req_id)
        if owned is None:
            owned = self._owned[req_id] = _Owned()
            if prefix:
                for bid in prefix.block_ids:
                    self._take(bid)
                owned.blocks.extend(prefix.block_ids)
                owned.hashes.extend(prefix.hashes)
        for _ in range(-(-num_tokens // self.block_size) - len(owned.blocks)):
            bid, _ = self._free.popitem(last=False)
            self._evict(bid)
            self.blocks[bid].ref_count = 1
            owned.blocks.append(bid)
        return True

    def cache_full_blocks(self, req_id: str, token_ids: list[int], num_tokens: int, root: int = ROOT_HASH) -> None:
        """Register the blocks fully covered by the first `num_tokens` of `token_ids` (their
        KV is, or is being, computed) in the prefix cache; `root` as in `match_prefix`."""
        if not self.enable_caching:
            return
        owned = self._owned[req_id]
        bs = self.block_size
        parent = owned.hashes[-1] if owned.hashes else root
        for b in range(len(owned.hashes), min(num_tokens // bs, len(owned.blocks))):
            chunk = token_ids[b * bs:(b + 1) * bs]
            h = hash_block(parent, chunk, self.namespace)
            owned.hashes.append(h)
            block = self.blocks[owned.blocks[b]]
            if block.block_hash is None and h not in self._cached:
                block.block_hash = h
                self._cached[h] = block.block_id
                self._emit(lambda s: BlockStored(s, h, parent, tuple(chunk), block.block_id))
            parent = h

    def sharers(self, req_id: str, start: int, n: int) -> set[str]:
        """The other requests holding a block of `req_id`'s `n` tokens from `start` (a prefix
        they matched while those tokens were being computed)."""
        owned, bs, end = self._owned.get(req_id), self.block_size, start + n
        if owned is None or n <= 0:
            return set()
        mine = {b for b in owned.blocks[start // bs:(end - 1) // bs + 1] if self.blocks[b].ref_count > 1}
        return {rid for rid, o in self._owned.items() if rid != req_id and mine.intersection(o.blocks)} if mine else set()

    def uncache_from(self, req_id: str, num_tokens: int) -> None:
        """Take `req_id`'s blocks past its first `num_tokens` tokens out of the prefix cache
        (their KV was to be computed in a step that stopped before it was): nobody may match a
        block whose KV is not there. They stay the request's (and whoever else's took them as a
        prefix meanwhile: the caller preempts those); the next step registers them again."""
        owned = self._owned.get(req_id)
        if owned is None or not self.enable_caching:
            return
        keep = num_tokens // self.block_size
        for b, h in list(enumerate(owned.hashes))[keep:]:
            block = self.blocks[owned.blocks[b]]
            if block.block_hash == h:
                block.block_hash = None
                del self._cached[h]
                self._emit(lambda s, h=h, bid=block.block_id: BlockRemoved(s, h, bid))
        del owned.hashes[keep:]

    def free(self, req_id: str) -> None:
        """Release all of `req_id`'s blocks (tail first); cached ones stay reusable."""
        owned = self._owned.pop(req_id, None)
        if owned is None:
            return
        for bid in reversed(owned.blocks):
            block = self.blocks[bid]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {bid} freed twice"
            if block.ref_count == 0:
                self._free[bid] = None

    def snapshot(self) -> tuple[list[int], int]:
        """Hashes of every cached block and the number of the last event emitted: the
        state a prefix index resyncs to."""
        return list(self._cached), self._event_seq

    def reset_prefix_cache(self) -> bool:
        """Forget all cached content; only possible when no block is in use."""
        if self.num_used_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()
        if self.tiers is not None:
            self.tiers.clear()
        self._emit(AllBlocksCleared)
        return True

    # ---- internals --------------------------------------------------------------------
    def _take(self, bid: int) -> None:
        block = self.blocks[bid]
        if block.ref_count == 0:
            del self._free[bid]
        block.ref_count += 1

    def _evict(self, bid: int) -> None:
        block = self.blocks[bid]
        if block.block_hash is not None:
            if self.tiers is not None:  # its KV is intact until the new owner writes it
                self.tiers.store(block.block_hash, bid)
            h, block.block_hash = block.block_hash, None
            del self._cached[h]
            self._emit(lambda s: BlockRemoved(s, h, bid))

    def _emit(self, make) -> None:
        if self.listener is None:
            return
        self._event_seq += 1
        event: KVEvent = make(self._event_seq)
        self.listener(event)

    def check_invariants(self) -> None:
        """Assert exact accounting (tests call this after every scenario)."""
        refs = [0] * self.num_blocks
        for owned in self._owned.values():
            for bid in owned.blocks:
                refs[bid] += 1
        for block in self.blocks:
            assert block.ref_count == refs[block.block_id], f"block {block.block_id} ref count"
            assert (block.ref_count == 0) == (block.block_id in self._free), f"block {block.block_id} free state"
            if block.block_hash is not None:
                assert self._cached[block.block_hash] == block.block_id
        assert len(self._cached) == sum(b.block_hash is not None for b in self.blocks)
