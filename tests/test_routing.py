"""Prefix index and routing policies, without a network."""
import pytest

from engine.block_hash import hash_blocks
from engine.block_manager import BlockManager
from engine.events import AllBlocksCleared, BlockRemoved, BlockStored
from router.policies import NoWorkerError, WorkerLoad, make_policy
from router.prefix_index import PrefixIndex


def stored(seq, h):
    return BlockStored(seq, h, 0, (), 0)


def test_index_follows_a_real_block_manager():
    """Feed the index from a block manager's own events: it knows exactly what is cached."""
    index = PrefixIndex()
    bm = BlockManager(4, 4, listener=lambda e: index.apply("p0", e))
    prompt = list(range(12))
    bm.allocate("a", 12)
    bm.cache_full_blocks("a", prompt, 12)
    hashes = hash_blocks(prompt + [99], 4)
    assert index.match(hashes) == {"p0": 3}
    bm.free("a")
    bm.allocate("b", 8)  # takes the never-used block, then evicts a's tail block
    assert index.match(hashes) == {"p0": 2}
    assert index.num_blocks("p0") == bm.num_cached_blocks
    bm.free("b")


def test_match_counts_leading_blocks_per_worker():
    index = PrefixIndex()
    for seq, h in enumerate([1, 2, 3], start=1):
        index.apply("a", stored(seq, h))
    for seq, h in enumerate([1, 5], start=1):
        index.apply("b", stored(seq, h))
    assert index.match([1, 2, 3, 4]) == {"a": 3, "b": 1}
    assert index.match([9, 2]) == {}  # the first block is nowhere: nothing matches
    index.apply("a", BlockRemoved(4, 2, 0))
    assert index.match([1, 2, 3]) == {"a": 1, "b": 1}
    index.apply("a", AllBlocksCleared(5))
    assert index.match([1]) == {"b": 1}


def test_gap_marks_worker_for_resync_until_snapshot():
    index = PrefixIndex()
    index.apply("a", stored(1, 10))
    assert index.apply("a", stored(1, 10))  # duplicate: ignored
    assert not index.apply("a", stored(3, 11))  # event 2 lost
    assert "a" in index.needs_resync
    assert index.match([10]) == {}  # distrusted
    assert not index.apply("a", stored(4, 12))
    index.reset_worker("a", [10, 11, 12], seq=4)
    assert index.match([10, 11, 12]) == {"a": 3}
    assert index.apply("a", stored(5, 13))
    index.remove_worker("a")
    assert index.match([10]) == {}


def test_prefix_aware_prefers_the_worker_holding_the_prefix():
    index = PrefixIndex()
    for seq, h in enumerate([1, 2, 3, 4], start=1):
        index.apply("p1", stored(seq, h))
    policy = make_policy("prefix_aware", index)
    workers = [WorkerLoad("p0"), WorkerLoad("p1")]
    choice = policy.pick_prefill(workers, [1, 2, 3, 4, 5], num_tokens=90, block_size=16)
    assert choice.worker_id == "p1" and choice.cached_tokens == 64
    # ...unless it is so busy that computing everything elsewhere is cheaper
    busy = [WorkerLoad("p0"), WorkerLoad("p1", queued_prefill_tokens=500)]
    assert policy.pick_prefill(busy, [1, 2, 3, 4, 5], 90, 16).worker_id == "p0"
    # a little busier than the cold worker is not enough: moving would also duplicate the
    # 64-token prefix in a second cache (26 + 100 now vs 90 + 64 duplicated)
    warm_busy = [WorkerLoad("p0"), WorkerLoad("p1", queued_prefill_tokens=100)]
    assert policy.pick_prefill(warm_busy, [1, 2, 3, 4, 5], 90, 16).worker_id == "p1"
    # nothing cached anywhere: pure load balancing
    assert policy.pick_prefill(warm_busy, [9, 8], 90, 16).worker_id == "p0"


def test_round_robin_alternates_and_least_loaded_balances():
    rr = make_policy("round_robin", PrefixIndex())
    workers = [WorkerLoad("p1"), WorkerLoad("p0")]
    assert [rr.pick_prefill(workers, [], 10, 16).worker_id for _ in range(4)] == ["p0", "p1", "p0", "p1"]
    ll = make_policy("least_loaded", PrefixIndex())
    assert ll.pick_prefill([WorkerLoad("a", 300), WorkerLoad("b", 100)], [], 10, 16).worker_id == "b"
    decode = [WorkerLoad("d0", kv_usage=0.7), WorkerLoad("d1", kv_usage=0.2), WorkerLoad("d2", kv_usage=0.2, running=3)]
    assert ll.pick_decode(decode) == "d1"


def test_unhealthy_workers_are_skipped_and_none_left_is_an_error():
    ll = make_policy("least_loaded", PrefixIndex())
    assert ll.pick_decode([WorkerLoad("d0", healthy=False), WorkerLoad("d1", kv_usage=0.9)]) == "d1"
    with pytest.raises(NoWorkerError, match="decode"):
        ll.pick_decode([WorkerLoad("d0", healthy=False)])
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("random", PrefixIndex())
