"""Each route says where its prompt is computed (`Route.placement`, counted by the router as
`pdserve_prompt_placements_total{where}`): the prefill pool; its decode worker for an urgent
short prompt (more urgent than every stream there, where every step of less urgent work stops
for it), or by load; or its decode worker for want of a prefill pool."""
from __future__ import annotations

from collections import Counter

from pdserve.router.cluster import PLACEMENTS, ClusterClient, WorkerEndpoint
from pdserve.router.policies import URGENT_LOCAL_PREFILL, urgent_prefill_on_decode


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
