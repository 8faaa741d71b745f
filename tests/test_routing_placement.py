"""Each route says where its prompt is computed (`Route.placement`, counted by the router as
`pdserve_prompt_placements_total{where}`): the prefill pool, its decode worker by load, or its
decode worker for want of a prefill pool."""
from __future__ import annotations

from pdserve.router.cluster import PLACEMENTS, ClusterClient, WorkerEndpoint


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
    assert {first.placement, lent.placement, "decode"} == set(PLACEMENTS)
