"""Block manager: exact block ids, reference counts, LRU eviction order and events."""
from pdserve.common.block_hash import ROOT_HASH, hash_block, hash_blocks
from pdserve.engine.core.block_manager import BlockManager
from pdserve.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored


def make(num_blocks=8, bs=4, **kw):
    events = []
    bm = BlockManager(num_blocks, bs, listener=events.append, **kw)
    return bm, events


def toks(n, start=0):
    return list(range(start, start + n))


def test_allocate_and_free_exact_ids():
    bm, _ = make()
    assert bm.allocate("a", 6)  # 2 blocks
    assert bm.block_table("a") == [0, 1]
    assert bm.allocate("a", 9)  # grows to 3
    assert bm.block_table("a") == [0, 1, 2]
    assert bm.allocate("b", 4)
    assert bm.block_table("b") == [3]
    assert bm.num_free_blocks == 4
    bm.free("a")
    assert bm.num_free_blocks == 7
    bm.check_invariants()
    # freed tail-first: the next allocation takes a's last block first
    assert bm.allocate("c", 4)
    assert bm.block_table("c") == [4]  # never-used blocks come before recently freed ones
    bm.free("b"); bm.free("c")
    bm.check_invariants()


def test_allocation_fails_without_side_effects():
    bm, _ = make(num_blocks=3)
    assert bm.allocate("a", 8)
    assert not bm.allocate("b", 8)
    assert bm.block_table("b") == [] and bm.num_free_blocks == 1
    bm.free("a")
    bm.check_invariants()


def test_block_hashes_chain_and_namespace():
    t = toks(8)
    h = hash_blocks(t, 4)
    assert h == [hash_block(ROOT_HASH, t[:4]), hash_block(h[0], t[4:])]
    assert hash_blocks(t, 4, namespace="lora-1") != h
    assert hash_blocks(t[:7], 4) == h[:1]  # partial block has no hash
    assert hash_blocks(toks(4, 100) + t[4:], 4)[1] != h[1]  # same tokens, other parent


def test_prefix_hit_shares_blocks_and_counts_refs():
    bm, events = make()
    prompt = toks(10)
    assert bm.allocate("a", 10)
    bm.cache_full_blocks("a", prompt, 10)
    assert [type(e) for e in events] == [BlockStored, BlockStored]
    assert [e.seq for e in events] == [1, 2]
    assert events[1].parent_hash == events[0].block_hash
    match = bm.match_prefix(prompt + [99])
    assert match.block_ids == (0, 1) and match.num_tokens == 8
    assert bm.allocate("b", 11, match)
    assert bm.block_table("b") == [0, 1, 3]
    assert [bm.blocks[i].ref_count for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    bm.free("a")
    assert [bm.blocks[i].ref_count for i in (0, 1, 2)] == [1, 1, 0]
    bm.free("b")
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks == 2
    bm.check_invariants()


def test_match_always_leaves_one_token_to_compute():
    bm, _ = make()
    prompt = toks(8)
    bm.allocate("a", 8)
    bm.cache_full_blocks("a", prompt, 8)
    bm.free("a")
    assert bm.match_prefix(prompt).num_tokens == 4  # not 8: the last token's logits are needed
    assert bm.match_prefix(prompt + [1]).num_tokens == 8


def test_freed_cached_blocks_are_reused_then_evicted_lru():
    bm, events = make(num_blocks=4, bs=4)
    for rid, start in (("a", 0), ("b", 100)):
        bm.allocate(rid, 8)
        bm.cache_full_blocks(rid, toks(8, start), 8)
    bm.free("a")  # a: [0, 1] -> queue gets 1, 0
    bm.free("b")  # b: [2, 3] -> queue gets 3, 2
    assert list(bm._free) == [1, 0, 3, 2]
    # a hit takes blocks out of the middle of the queue
    m = bm.match_prefix(toks(8, 100) + [5])
    assert m.block_ids == (2, 3)
    events.clear()
    assert bm.allocate("c", 9, m)  # 2 reused + 1 new, taken from the queue head (block 1)
    assert bm.block_table("c") == [2, 3, 1]
    assert [(type(e), e.block_id) for e in events] == [(BlockRemoved, 1)]
    assert list(bm._free) == [0]
    assert not bm.allocate("d", 8)  # needs 2, one is free
    bm.free("c")
    bm.check_invariants()


def test_eviction_order_and_removed_events():
    bm, events = make(num_blocks=4, bs=4)
    bm.allocate("a", 8)
    bm.cache_full_blocks("a", toks(8), 8)
    bm.free("a")
    events.clear()
    assert bm.allocate("b", 4)
    # the queue was [2, 3, 1, 0]: never-used blocks first, then a's tail before its head
    assert bm.block_table("b") == [2]
    assert bm.allocate("c", 12)
    assert bm.block_table("c") == [3, 1, 0]
    assert [type(e) for e in events] == [BlockRemoved, BlockRemoved]
    assert [e.block_id for e in events] == [1, 0]
    assert bm.num_cached_blocks == 0
    assert bm.match_prefix(toks(8) + [1]).num_tokens == 0
    bm.free("b"); bm.free("c")
    bm.check_invariants()


def test_duplicate_content_is_not_cached_twice():
    bm, events = make()
    for rid in ("a", "b"):  # both computed the same prompt without sharing
        bm.allocate(rid, 4)
        bm.cache_full_blocks(rid, toks(4), 4)
    assert bm.num_cached_blocks == 1 and len(events) == 1
    bm.free("a"); bm.free("b")
    bm.check_invariants()


def test_reset_prefix_cache_only_when_idle():
    bm, events = make()
    bm.allocate("a", 4)
    bm.cache_full_blocks("a", toks(4), 4)
    assert not bm.reset_prefix_cache()
    bm.free("a")
    assert bm.reset_prefix_cache()
    assert isinstance(events[-1], AllBlocksCleared) and bm.num_cached_blocks == 0
    bm.check_invariants()


def test_caching_disabled_emits_nothing():
    bm, events = make(enable_caching=False)
    bm.allocate("a", 8)
    bm.cache_full_blocks("a", toks(8), 8)
    assert events == [] and bm.match_prefix(toks(9)).num_tokens == 0
    bm.free("a")
