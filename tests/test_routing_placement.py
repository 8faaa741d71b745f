"""Each route says where its prompt is computed (`Route.placement`, counted by the router as
`pdserve_prompt_placements_total{where}`): the prefill pool; its decode worker for an urgent
short prompt (more urgent than every stream there, where every step of less urgent work stops
for it), or by load; or its decode worker for want of a prefill pool."""
from __future__ import annotations

from collections import Counter

import pytest

from pdserve.common.block_hash import hash_blocks
from pdserve.router.cluster import PLACEMENTS, ClusterClient, WorkerEndpoint
from pdserve.router.policies import (DECODE_PREFILL_SLOWDOWN, FULL_DECODE_STREAMS, URGENT_LOCAL_PREFILL,
                                     decode_prefill_slowdown, prefill_on_decode, urgent_prefill_on_decode)


def test_each_route_says_where_its_prompt_is_computed():
    c = ClusterClient(routing="prefix_aware", block_size=16, prefill_queue_limit=200)
    c.set_workers([WorkerEndpoint("p0", "prefill", "a:1"), WorkerEndpoint("d0", "decode", "a:2")])
    c.healthy = {"p0": True, "d0": True}
    first = c.route([1] * 300)
    assert first.placement == "prefill_pool" and first.prefill.worker_id == "p0"
    lent = c.route([4] * 50)  # the prefill queue is past its limit and this prompt is short
    assert lent.placement == "decode_load" and lent.prefill is None
    solo = ClusterClient(routing="prefix_aware", block_size=16)
    solo.set_workers([WorkerEndpoint("a0", "aggregated", "a:3")])
    solo.healthy = {"a0": True}
    assert solo.route([5] * 10).placement == "decode"
    urgent = c.route([6] * 80, priority=-10)  # more urgent than the streams on d0
    assert urgent.placement == "decode_urgent" and urgent.prefill is None
    assert {first.placement, urgent.placement, lent.placement, "decode"} == set(PLACEMENTS)


def test_the_urgent_rule():
    flood = Counter({0: 24})
    assert urgent_prefill_on_decode(-10, flood, 100)
    assert urgent_prefill_on_decode(-1, flood, URGENT_LOCAL_PREFILL)
    assert not urgent_prefill_on_decode(-10, flood, URGENT_LOCAL_PREFILL + 1)  # a long prompt: the prefill pool
    assert not urgent_prefill_on_decode(0, flood, 100)  # as urgent as a stream there: not urgent
    assert not urgent_prefill_on_decode(-10, Counter({0: 3, -10: 1}), 100)
    assert not urgent_prefill_on_decode(-10, Counter(), 100)  # no streams: the idle and load rules decide


def test_an_urgent_short_prompt_is_prefilled_on_the_decode_worker_beside_a_flood():
    c = ClusterClient(routing="prefix_aware", block_size=16)  # no lending by load: the flood stays on p0
    c.set_workers([WorkerEndpoint("p0", "prefill", "a:1"), WorkerEndpoint("d0", "decode", "a:2")])
    c.healthy = {"p0": True, "d0": True}
    flood = [c.route([g * 1000 + i for i in range(300)]) for g in range(6)]  # priority 0 streams
    assert all(r.prefill is not None and r.prefill.worker_id == "p0" for r in flood)
    chat = c.route([7] * 80, priority=-10)
    assert chat.prefill is None and c.pending_prefill["d0"] == 80  # the decode worker computes it
    long = c.route([8] * 600, priority=-10)
    assert long.prefill is not None and long.prefill.worker_id == "p0"  # past one chunk: the prefill pool
    same = c.route([9] * 80, priority=0)
    assert same.prefill is not None  # not more urgent than the streams there
    for r in (*flood, chat, long, same):
        c.settle(r, prefilled_remotely=r.prefill is not None)
        c.release(r)
    assert c.pending_prefill == {} and c.decode_streams == {} and c.decode_priorities == {}


def test_prefill_moves_to_the_decode_worker_only_when_the_prefill_queue_is_deep():
    # below the limit: the prefill pool, however idle the decode worker
    assert not prefill_on_decode(prefill_backlog=511, decode_backlog=0, todo=250, limit=512)
    # at the limit, and the prompt would be done sooner on the decode worker, which prefills
    # at a third of the speed (full of streams, the default): 3 * 250 < 512 + 250, 3 * 260 > 512 + 260
    assert prefill_on_decode(prefill_backlog=512, decode_backlog=0, todo=250, limit=512)
    assert not prefill_on_decode(prefill_backlog=512, decode_backlog=0, todo=260, limit=512)
    assert prefill_on_decode(prefill_backlog=3501, decode_backlog=1000, todo=250, limit=512)
    # ...but not if the decode worker's own queue is a third as long
    assert not prefill_on_decode(prefill_backlog=3500, decode_backlog=1000, todo=250, limit=512)
    assert not prefill_on_decode(prefill_backlog=10**6, decode_backlog=0, todo=10, limit=0)  # 0: off


def test_a_saturated_prefill_pool_lends_prompts_to_its_decode_worker_and_takes_them_back():
    """A burst of prompts beside a decode worker full of streams: the first ones queue on the
    prefill worker; once its queue reaches the limit, a prompt goes to the decode worker while
    its queue there would be done sooner (at a third of the speed); as prompts settle, the
    tokens come off the worker that computes them, and new ones go to the prefill pool again."""
    from pdserve.protos import worker_pb2 as pb
    c = ClusterClient(routing="prefix_aware", block_size=16, prefill_queue_limit=500)
    c.set_workers([WorkerEndpoint("p0", "prefill", "a:1"), WorkerEndpoint("d0", "decode", "a:2")])
    c.healthy = {"p0": True, "d0": True}
    c.stats = {"d0": pb.WorkerStats(running=FULL_DECODE_STREAMS)}  # another router's streams
    prompts = [[g * 1000 + i for i in range(250)] for g in range(8)]
    routes = [c.route(p) for p in prompts]
    where = [r.prefill.worker_id if r.prefill else "d0" for r in routes]
    # the 4th: 3 * 250 < 750 + 250 queued; the 8th: 3 * 500 < 1,500 + 250
    assert where == ["p0", "p0", "p0", "d0", "p0", "p0", "p0", "d0"], where
    assert c.pending_prefill == {"p0": 6 * 250, "d0": 2 * 250}
    # a prompt prefilled on the decode worker is not expected in the prefill worker's cache
    assert c.index.match(hash_blocks(prompts[3], 16, "")).get("p0", 0) == 0
    assert c.index.match(hash_blocks(prompts[4], 16, "")).get("p0", 0) == 15
    for r in routes:
        c.settle(r, prefilled_remotely=r.prefill is not None)
        c.release(r)
    assert c.pending_prefill == {} and c.decode_streams == {}
    assert c.route(prompts[0][:10] + [5] * 240).prefill.worker_id == "p0"


def test_a_decode_worker_with_few_streams_takes_a_larger_share_of_a_burst_of_long_prompts():
    """The decode worker's prefill costs more the more streams it decodes: from the prefill
    worker's speed with none to DECODE_PREFILL_SLOWDOWN times it with FULL_DECODE_STREAMS. A
    burst of 8 ~2,000-token prompts (the first on the idle decode worker) then leaves 3 of 8 on
    the decode worker, where a fixed 3x left 2 and its core idle while the prefill worker's
    queue ran 6 prompts deep; full of streams (never idle) it takes 2."""
    from pdserve.protos import worker_pb2 as pb
    assert decode_prefill_slowdown(0) == 1.0
    assert decode_prefill_slowdown(FULL_DECODE_STREAMS // 2) == pytest.approx((1 + DECODE_PREFILL_SLOWDOWN) / 2)
    assert decode_prefill_slowdown(FULL_DECODE_STREAMS) == decode_prefill_slowdown(10 * FULL_DECODE_STREAMS) == 3
    # 3,000 tokens queued on the prefill worker, 2,000 on the decode worker: a 1,000-token
    # prompt goes there with no stream (3,000 < 4,000), not with 16 (2 * 3,000 > 4,000)
    assert prefill_on_decode(3000, 2000, 1000, limit=512, decode_streams=0)
    assert not prefill_on_decode(3000, 2000, 1000, limit=512, decode_streams=FULL_DECODE_STREAMS // 2)
    prompts = [[g * 10000 + i for i in range(2000)] for g in range(8)]
    placed = {}
    for busy in (0, FULL_DECODE_STREAMS):
        c = ClusterClient(routing="prefix_aware", block_size=16, prefill_queue_limit=512, idle_decode_prefill=True)
        c.set_workers([WorkerEndpoint("p0", "prefill", "a:1"), WorkerEndpoint("d0", "decode", "a:2")])
        c.healthy = {"p0": True, "d0": True}
        if busy:
            c.stats = {"d0": pb.WorkerStats(running=busy)}
        routes = [c.route(p) for p in prompts]
        placed[busy] = [r.prefill.worker_id if r.prefill else "d0" for r in routes]
        for r in routes:
            c.settle(r, prefilled_remotely=r.prefill is not None)
            c.release(r)
        assert c.pending_prefill == {} and c.decode_streams == {}
    assert placed[0] == ["d0", "p0", "p0", "d0", "p0", "d0", "p0", "p0"], placed[0]
    # full of streams: never idle, and 3x: 3 * 2,000 < 6,000 + 2,000, then 3 * 4,000 < 12,000 + 2,000
    assert placed[FULL_DECODE_STREAMS] == ["p0"] * 3 + ["d0"] + ["p0"] * 3 + ["d0"], placed[FULL_DECODE_STREAMS]


def test_an_idle_decode_worker_prefills_the_prompt_itself_a_busy_one_does_not():
    """With idle_decode_prefill, a prompt whose decode worker has no stream and no prompt of its
    own is prefilled there (no hand-off); once a stream runs there, prompts go to the prefill
    pool again (its ITL would pay), and back when the stream ends."""
    assert prefill_on_decode(prefill_backlog=0, decode_backlog=0, todo=250, limit=0, decode_idle=True)
    c = ClusterClient(routing="prefix_aware", block_size=16, prefill_queue_limit=512, idle_decode_prefill=True)
    c.set_workers([WorkerEndpoint("p0", "prefill", "a:1"), WorkerEndpoint("d0", "decode", "a:2")])
    c.healthy = {"p0": True, "d0": True}
    prompts = [[g * 1000 + i for i in range(250)] for g in range(4)]
    first = c.route(prompts[0])
    assert first.prefill is None and c.pending_prefill == {"d0": 250}
    c.settle(first, prefilled_remotely=False)  # its first token: the stream still runs
    second = c.route(prompts[1])
    assert second.prefill.worker_id == "p0"
    for r in (first, second):
        c.settle(r)
        c.release(r)
    assert c.route(prompts[2]).prefill is None  # idle again
    off = ClusterClient(routing="prefix_aware", block_size=16, prefill_queue_limit=512)
    off.set_workers(c.workers.values())
    off.healthy = dict(c.healthy)
    assert off.route(prompts[3]).prefill.worker_id == "p0"  # off (the default here): the prefill pool
