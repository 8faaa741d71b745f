"""Prefix index and routing policies, without a network."""
import pytest

from pdserve.common.block_hash import hash_blocks
from pdserve.engine.core.block_manager import BlockManager
from pdserve.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from pdserve.router.cluster import ClusterClient, WorkerEndpoint
from pdserve.router.policies import NoWorkerError, WorkerLoad, make_policy
from pdserve.router.prefix_index import PrefixIndex


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
    def policy():  # each case on a fresh index: a choice counts as cached where it went
        index = PrefixIndex()
        for seq, h in enumerate([1, 2, 3, 4], start=1):
            index.apply("p1", stored(seq, h))
        return make_policy("prefix_aware", index)

    workers = [WorkerLoad("p0"), WorkerLoad("p1")]
    choice = policy().pick_prefill(workers, [1, 2, 3, 4, 5], num_tokens=90, block_size=16)
    assert choice.worker_id == "p1" and choice.cached_tokens == 64
    # ...unless it is so busy that computing everything elsewhere is cheaper
    busy = [WorkerLoad("p0"), WorkerLoad("p1", queued_prefill_tokens=500)]
    assert policy().pick_prefill(busy, [1, 2, 3, 4, 5], 90, 16).worker_id == "p0"
    # a little busier than the cold worker is not enough: moving would also duplicate the
    # 64-token prefix in a second cache (26 + 100 now vs 90 + 64 duplicated)
    warm_busy = [WorkerLoad("p0"), WorkerLoad("p1", queued_prefill_tokens=100)]
    assert policy().pick_prefill(warm_busy, [1, 2, 3, 4, 5], 90, 16).worker_id == "p1"
    # nothing cached anywhere: pure load balancing
    assert policy().pick_prefill(warm_busy, [9, 8], 90, 16).worker_id == "p0"


def test_prompts_of_a_new_prefix_follow_the_first_before_its_events_arrive():
    """The first prompt of a prefix goes by load; the next ones, sent before the first one's
    prefill has produced any KV event, find it there rather than going by (stale) load."""
    index = PrefixIndex()
    policy = make_policy("prefix_aware", index)
    idle = [WorkerLoad("p0"), WorkerLoad("p1")]
    prefix = [11, 12, 13, 14]
    first = policy.pick_prefill(idle, prefix + [100], 80, 16)
    assert first.worker_id == "p0" and first.cached_tokens == 0
    # the heartbeat has not caught up: p0 still reports no load
    for question in (101, 102, 103):
        again = policy.pick_prefill(idle, prefix + [question], 80, 16)
        assert again.worker_id == "p0" and again.cached_tokens == 64
    # a different prefix still goes by load, and is expected where it went
    other = policy.pick_prefill([WorkerLoad("p0", queued_prefill_tokens=300), WorkerLoad("p1")], [21, 22], 40, 16)
    assert other.worker_id == "p1" and index.match([21, 22]) == {"p1": 2}


def test_expected_blocks_end_at_their_events_or_their_deadline():
    index = PrefixIndex()
    index.expect("p0", [1, 2, 3], ttl_s=10.0, now=100.0)
    assert index.match([1, 2, 3], now=100.0) == {"p0": 3}
    # the worker's events confirm two blocks; the third never comes (evicted at once, say)
    index.apply("p0", stored(1, 1))
    index.apply("p0", stored(2, 2))
    assert index.match([1, 2, 3], now=105.0) == {"p0": 3}
    assert index.match([1, 2, 3], now=111.0) == {"p0": 2}  # past its deadline: only what events say
    index.apply("p0", BlockRemoved(3, 2, 0))
    assert index.match([1, 2, 3], now=111.0) == {"p0": 1}  # an event removes a confirmed block
    # a worker that leaves takes its expectations with it; a worker under resync has none counted
    index.expect("p1", [7, 8], ttl_s=10.0, now=200.0)
    index.expect("p2", [7], ttl_s=10.0, now=200.0)
    index.apply("p2", stored(5, 9))  # a gap: p2 is distrusted
    assert index.match([7, 8], now=201.0) == {"p1": 2}
    index.remove_worker("p1")
    assert index.match([7, 8], now=201.0) == {}
    index.expect("p3", [40], ttl_s=1.0, now=300.0)  # expiry sweeps the stale entries
    assert not index._expecting.get("p1") and index._expected.get(8) is None


def test_a_withdrawn_expectation_leaves_later_ones_and_confirmed_blocks():
    index = PrefixIndex()
    first = index.expect("p0", [1, 2, 3], ttl_s=30.0, now=100.0)
    index.apply("p0", stored(1, 1))  # block 1 is confirmed by its event
    later = index.expect("p0", [3, 4], ttl_s=30.0, now=101.0)  # another prompt renews block 3
    index.withdraw("p0", [1, 2, 3], first)
    assert index.match([1, 2, 3], now=102.0) == {"p0": 1}  # 1: the event stands; 2: withdrawn
    assert index.match([3, 4], now=102.0) == {"p0": 2}     # the later prompt's expectation stays
    index.withdraw("p0", [3, 4], later)
    assert index.match([3, 4], now=102.0) == {} and not index._expecting
    # two prompts in flight with one prefix (same tick, even): one of them gone leaves the other
    a = index.expect("p1", [7, 8], ttl_s=30.0, now=200.0)
    b = index.expect("p1", [7, 8], ttl_s=30.0, now=200.0)
    index.withdraw("p1", [7, 8], b)
    assert index.match([7, 8], now=201.0) == {"p1": 2}
    index.withdraw("p1", [7, 8], a)
    assert index.match([7, 8], now=201.0) == {}
    # an earlier prompt's expectation outlives a later one that was withdrawn, until its own deadline
    early = index.expect("p2", [9], ttl_s=30.0, now=300.0)
    index.withdraw("p2", [9], index.expect("p2", [9], ttl_s=30.0, now=310.0))
    assert index.match([9], now=329.0) == {"p2": 1} and index.match([9], now=331.0) == {}
    index.withdraw("p2", [9], early)
    index.expect("p3", [1], ttl_s=1.0, now=400.0)  # sweeps what expired
    assert set(index._expecting) == {"p3"}


def test_a_prompt_the_prefill_worker_never_computed_is_not_expected_there():
    """The decode worker prefilled it itself (or the request failed or moved before its first
    token): the next prompt with its prefix must not be sent to that prefill worker for a
    cache it does not have."""
    c = ClusterClient(routing="prefix_aware", block_size=16)
    c.set_workers([WorkerEndpoint("p0", "prefill", "a:1"), WorkerEndpoint("p1", "prefill", "a:2"),
                   WorkerEndpoint("d0", "decode", "a:3")])
    c.healthy = {"p0": True, "p1": True, "d0": True}
    prompt = list(range(500, 564))
    blocks = hash_blocks(prompt, 16, "")

    def held_by_prefill():
        return {w: n for w, n in c.index.match(blocks).items() if w.startswith("p")}

    taken_by_decode = c.route(prompt)
    assert held_by_prefill() == {"p0": 4}
    c.settle(taken_by_decode, prefilled_remotely=False)
    assert held_by_prefill() == {}
    computed = c.route(prompt)
    c.settle(computed, prefilled_remotely=True)
    c.release(computed)  # a later release does not withdraw what was computed
    assert held_by_prefill() == {computed.prefill.worker_id: 4}
    refused = c.route(list(range(900, 964)))
    c.release(refused)  # no first token ever came
    assert {w for w in c.index.match(hash_blocks(list(range(900, 964)), 16, "")) if w.startswith("p")} == set()


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


def test_the_router_counts_the_prefills_it_sent_before_the_workers_report_them():
    """Between two stats polls, every worker looks idle: new prompts are spread by what this
    router itself sent, and each route's tokens come off when it settles (once)."""
    c = ClusterClient(routing="prefix_aware", block_size=16)
    c.set_workers([WorkerEndpoint("p0", "prefill", "a:1"), WorkerEndpoint("p1", "prefill", "a:2"),
                   WorkerEndpoint("d0", "decode", "a:3")])
    c.healthy = {"p0": True, "p1": True, "d0": True}
    prompts = [[g * 1000 + i for i in range(64)] for g in range(4)]  # 4 new prefixes, 4 blocks each
    routes = [c.route(p) for p in prompts]
    assert [r.prefill.worker_id for r in routes] == ["p0", "p1", "p0", "p1"]
    assert c.pending_prefill == {"p0": 128, "p1": 128}
    # a prompt sharing the first prefix goes where it is expected to be cached; only its tail is new work
    again = c.route(prompts[0][:48] + [7] * 16)
    assert again.prefill.worker_id == "p0" and again.cached_tokens == 48 and again.prefill_tokens == 16
    for r in routes + [again, again]:
        c.settle(r)
    assert c.pending_prefill == {}


def test_decode_workers_are_picked_by_streams_then_by_the_prefix_they_hold():
    def policy():
        index = PrefixIndex()
        for seq, h in enumerate([1, 2, 3, 4], start=1):
            index.apply("d1", stored(seq, h))
        return make_policy("prefix_aware", index), index

    pa, index = policy()
    idle = [WorkerLoad("d0"), WorkerLoad("d1")]
    assert pa.pick_decode(idle, [1, 2, 3, 4, 5]) == "d1"  # holds the prompt's first 4 blocks: not sent again
    assert index.match([9, 8]) == {}
    assert pa.pick_decode(idle, [9, 8]) == "d0"  # held nowhere: by load (then id)
    # one stream more than the least loaded is within the slack; two are not
    assert policy()[0].pick_decode([WorkerLoad("d0"), WorkerLoad("d1", running=1)], [1, 2, 3]) == "d1"
    assert policy()[0].pick_decode([WorkerLoad("d0"), WorkerLoad("d1", running=2)], [1, 2, 3]) == "d0"
    # nearly out of KV: it would preempt streams to take the request, so the prefix does not count
    assert policy()[0].pick_decode([WorkerLoad("d0", kv_usage=0.5), WorkerLoad("d1", kv_usage=0.95)], [1, 2]) == "d0"
    # and load first: fewer streams beat lower KV use, until KV is nearly full
    ll = make_policy("least_loaded", PrefixIndex())
    assert ll.pick_decode([WorkerLoad("d0", running=3, kv_usage=0.1), WorkerLoad("d1", running=2, kv_usage=0.6)]) == "d1"
    assert ll.pick_decode([WorkerLoad("d0", running=3, kv_usage=0.1), WorkerLoad("d1", running=2, kv_usage=0.92)]) == "d0"
    assert ll.pick_decode(idle, [1, 2, 3, 4]) == "d0"  # least_loaded ignores the prefix


def test_the_router_counts_the_streams_it_opened_on_each_decode_worker():
    """A burst between two stats polls: every decode worker reports nothing running, so the
    router spreads the requests by the streams it opened itself, and gives each back once."""
    c = ClusterClient(routing="prefix_aware", block_size=16)
    c.set_workers([WorkerEndpoint("d0", "decode", "a:1"), WorkerEndpoint("d1", "decode", "a:2")])
    c.healthy = {"d0": True, "d1": True}
    routes = [c.route([g * 1000 + i for i in range(40)]) for g in range(6)]  # 6 prefixes seen nowhere
    assert [r.decode.worker_id for r in routes] == ["d0", "d1", "d0", "d1", "d0", "d1"]
    # with no prefill pool, each decode worker prefills its own prompts: their tokens are its load
    assert c.decode_streams == {"d0": 3, "d1": 3} and c.pending_prefill == {"d0": 120, "d1": 120}
    # a prompt sharing the 2nd one's prefix follows it there (d1 is within one stream of d0)
    c.release(routes[0])
    assert c.route([1000 + i for i in range(32)] + [5] * 8).decode.worker_id == "d1"
    for r in routes + routes:
        c.release(r)
    assert c.decode_streams == {"d1": 1} and c.pending_prefill == {"d1": 40}  # the last route is still open


def test_a_decode_workers_load_is_its_last_report_corrected_by_this_routers_streams_since():
    """Its report counted this router's streams as they were at the poll; those opened or
    closed since are counted now, and the streams of other routers are kept."""
    from pdserve.protos import worker_pb2 as pb

    c = ClusterClient(routing="least_loaded", block_size=16)
    c.set_workers([WorkerEndpoint("d0", "decode", "a:1"), WorkerEndpoint("d1", "decode", "a:2")])
    c.healthy = {"d0": True, "d1": True}
    c.stats = {"d0": pb.WorkerStats(running=4, waiting=1), "d1": pb.WorkerStats(running=2)}
    c.decode_streams, c._streams_at_poll = {"d0": 5, "d1": 0}, {"d0": 5, "d1": 0}  # d1's 2: another router's
    routes = [c.route(list(range(20))) for _ in range(4)]
    # d0: 5 reported, all 5 ours -> 5; d1: 2 of another router's + ours: 2, 3, 4, then 5 ties (by id)
    assert [r.decode.worker_id for r in routes] == ["d1", "d1", "d1", "d0"]
    c.decode_streams["d0"] = 1  # 5 of our streams on d0 ended since its report: it is nearly idle
    assert c.route(list(range(20))).decode.worker_id == "d0"



def test_routing_looks_prefixes_up_under_the_requests_cache_salt():
    c = ClusterClient(routing="prefix_aware", block_size=16)
    c.set_workers([WorkerEndpoint("p0", "prefill", "a:1"), WorkerEndpoint("p1", "prefill", "a:2"),
                   WorkerEndpoint("d0", "decode", "a:3")])
    c.healthy = {"p0": True, "p1": True, "d0": True}
    prompt = list(range(700, 764))
    a = c.route(prompt, cache_salt="tenant-a")
    assert a.cached_tokens == 0
    other = c.route(prompt, cache_salt="tenant-b")  # another tenant's copy: nothing to reuse
    assert other.cached_tokens == 0 and other.prefill.worker_id != a.prefill.worker_id
    again = c.route(prompt, cache_salt="tenant-a")
    assert again.prefill.worker_id == a.prefill.worker_id and again.cached_tokens == 64


def test_a_decode_worker_is_expected_to_hold_a_prompt_once_its_first_token_came():
    """The router counts a prompt's blocks on its decode worker at once; a route that ends
    before its first token (refused, failed, client gone) takes that back, a served one not."""
    c = ClusterClient(routing="prefix_aware", block_size=16)
    c.set_workers([WorkerEndpoint("d0", "decode", "a:1"), WorkerEndpoint("d1", "decode", "a:2")])
    c.healthy = {"d0": True, "d1": True}
    prompt = list(range(300, 348))
    blocks = hash_blocks(prompt, 16, "")
    refused = c.route(prompt)
    assert c.index.match(blocks) == {refused.decode.worker_id: 3}
    c.release(refused)
    assert c.index.match(blocks) == {}
    served = c.route(prompt)
    c.settle(served)
    c.release(served)
    assert c.index.match(blocks) == {served.decode.worker_id: 3}
    assert not make_policy("least_loaded", PrefixIndex()).follows_prefixes
    ll = ClusterClient(routing="least_loaded", block_size=16)
    ll.set_workers([WorkerEndpoint("d0", "decode", "a:1")])
    ll.healthy = {"d0": True}
    ll.route(prompt)
    assert ll.index.match(blocks) == {}  # only prefix_aware uses (and fills) the index


def test_a_prompt_is_not_lent_to_a_decode_worker_streaming_for_more_urgent_requests(monkeypatch):
    """A saturated prefill pool lends prompts to the decode worker, unless that worker streams
    for a more urgent request, or did within the urgent window: a low-priority prompt's chunks
    there would stretch the urgent stream's inter-token latency (measured: a 512-token chunk is a
    3-4 s step on one core), or its client's next request's first token, so it waits in the
    prefill pool's queue. Equal or less urgent streams there do not stop it, and once the urgent
    stream has ended and the window passed the lending resumes."""
    import time

    from pdserve.router.cluster import URGENT_WINDOW_S

    c = ClusterClient(routing="prefix_aware", block_size=16, prefill_queue_limit=500)
    c.set_workers([WorkerEndpoint("p0", "prefill", "a:1"), WorkerEndpoint("d0", "decode", "a:2")])
    c.healthy = {"p0": True, "d0": True}
    prompts = iter([[g * 1000 + i for i in range(250)] for g in range(12)])
    urgent = c.route(next(prompts), priority=-1)
    backlog = [c.route(next(prompts), priority=5) for _ in range(4)]  # the prefill queue reaches the limit
    assert urgent.prefill.worker_id == "p0" and all(r.prefill is not None for r in backlog)
    held = c.route(next(prompts), priority=5)
    assert held.prefill.worker_id == "p0"  # would be lent, but d0 streams for priority -1
    lent = c.route(next(prompts), priority=-1)
    assert lent.prefill is None  # as urgent as anything there: lent
    c.settle(urgent)
    c.release(urgent)
    assert c.decode_priorities["d0"] == {-1: 1, 5: 5}
    assert c.route(next(prompts), priority=5).prefill.worker_id == "p0"  # `lent` still streams at -1
    c.settle(lent, prefilled_remotely=False)
    c.release(lent)
    assert c.route(next(prompts), priority=5).prefill.worker_id == "p0"  # urgent within the window
    later = time.monotonic() + URGENT_WINDOW_S + 1
    monkeypatch.setattr(time, "monotonic", lambda: later)
    assert c.route(next(prompts), priority=5).prefill is None  # nothing more urgent there lately: lent again


def test_with_no_urgent_lend_window_a_prompt_is_lent_as_soon_as_the_urgent_stream_ends():
    """urgent_lend_window_s=0: the decode worker gets no less urgent prompt while it streams for
    a more urgent request, and gets one at once after (its window steps bound the chunks)."""
    c = ClusterClient(routing="prefix_aware", block_size=16, prefill_queue_limit=500, urgent_lend_window_s=0.0)
    c.set_workers([WorkerEndpoint("p0", "prefill", "a:1"), WorkerEndpoint("d0", "decode", "a:2")])
    c.healthy = {"p0": True, "d0": True}
    prompts = iter([[g * 1000 + i for i in range(250)] for g in range(8)])
    urgent = c.route(next(prompts), priority=-1)
    for _ in range(4):
        c.route(next(prompts), priority=5)  # the prefill queue reaches the limit
    assert c.route(next(prompts), priority=5).prefill.worker_id == "p0"  # d0 streams for priority -1
    c.settle(urgent)
    c.release(urgent)
    assert c.route(next(prompts), priority=5).prefill is None  # it ended: lent
