"""Prompts held in the router while every place to compute them is busy (router/holding.py):
when to hold, in which order they go, and a burst of long prompts bound to whichever worker
frees first instead of by the loads at their arrival. No network: the cluster's view is set by
hand, as the router's polls and settles set it."""
from __future__ import annotations

import asyncio

import pytest

from pdserve.protos import worker_pb2 as pb
from pdserve.router.cluster import ClusterClient, WorkerEndpoint
from pdserve.router.holding import HeldPrompts, must_hold
from pdserve.router.policies import FULL_DECODE_STREAMS, WorkerLoad


def test_a_prompt_is_held_only_while_every_prefill_queue_is_full_and_no_decode_worker_takes_it():
    full, short = WorkerLoad("p0", queued_prefill_tokens=3000), WorkerLoad("p1", queued_prefill_tokens=1000)
    busy = WorkerLoad("d0", queued_prefill_tokens=2000, running=FULL_DECODE_STREAMS)
    free = WorkerLoad("d1", running=2)
    assert must_hold([full], [busy], 2000, limit=512, idle_decode_prefill=True, hold_tokens=2048)
    assert not must_hold([full, short], [busy], 2000, 512, True, 2048)  # p1 has room
    assert not must_hold([full], [busy, free], 2000, 512, True, 2048)  # d1 would be done sooner
    assert not must_hold([full], [busy], 2000, 512, True, 4096)  # below this hold
    assert not must_hold([full], [busy], 2000, 512, True, 0)  # holding off
    assert not must_hold([full], [busy], 2000, 0, True, 2048)  # lending off: one place only
    assert not must_hold([], [busy], 2000, 512, True, 2048)  # no prefill pool
    down = WorkerLoad("p0", queued_prefill_tokens=0, healthy=False)
    assert must_hold([full, down], [busy], 2000, 512, True, 2048)  # an unhealthy worker has no room
    assert must_hold([full], [busy, WorkerLoad("d1", running=0, healthy=False)], 2000, 512, True, 2048)


def test_held_prompts_go_most_urgent_first_then_by_arrival_one_at_a_time():
    async def main():
        hold = {"on": True}
        held = HeldPrompts(lambda todo, priority: hold["on"])
        counted = []
        held.on_hold = lambda: counted.append(1)
        order = []

        async def one(name, priority):
            await held.wait(100, priority)
            order.append(name)

        tasks = [asyncio.create_task(one(n, p)) for n, p in (("a", 0), ("b", 5), ("c", 0), ("d", 2))]
        await asyncio.sleep(0.01)
        assert len(held) == 4 and order == [] and len(counted) == 4
        assert await asyncio.wait_for(held.wait(100, -1), 1) == 0.0  # more urgent than the default: never held
        held.wake()  # still full: no one goes
        await asyncio.sleep(0.01)
        assert order == []
        hold["on"] = False
        for n in range(4):
            held.wake()  # each wake lets one go
            await asyncio.sleep(0.01)
            assert len(order) == n + 1
        assert order == ["a", "c", "d", "b"] and len(held) == 0
        await asyncio.gather(*tasks)
        # a newcomer waits behind a held prompt as urgent as it, even once holding would let it go
        hold["on"] = True
        first = asyncio.create_task(one("e", 0))
        await asyncio.sleep(0.01)
        hold["on"] = False
        second = asyncio.create_task(one("f", 0))
        await asyncio.sleep(0.01)
        assert order[4:] == [] and len(held) == 2
        held.wake()
        await asyncio.sleep(0.01)
        held.wake()
        await asyncio.gather(first, second)
        assert order[4:] == ["e", "f"]
    asyncio.run(main())


def test_a_held_prompt_whose_client_leaves_or_that_waits_too_long_lets_the_next_go():
    async def main():
        hold = {"on": True}
        held = HeldPrompts(lambda todo, priority: hold["on"], max_s=0.2)
        gone = asyncio.create_task(held.wait(100))
        await asyncio.sleep(0.01)
        late = asyncio.create_task(held.wait(100))
        await asyncio.sleep(0.01)
        gone.cancel()  # its client left
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert len(held) == 1
        waited = await asyncio.wait_for(late, 2)  # nothing frees: it goes after max_s all the same
        assert 0.15 < waited < 1.5 and len(held) == 0
    asyncio.run(main())


def test_a_burst_of_long_prompts_binds_each_to_the_worker_that_frees_first():
    """8 ~2,000-token prompts at once: the idle decode worker takes the first, the prefill
    worker two (its queue then past hold_tokens), the decode worker one more (done sooner
    there), the other four wait in the router. Whichever worker settles a prompt gets the next
    held one: 4 and 4, each when its worker is free, not by a guess at the burst's arrival."""
    async def main():
        c = ClusterClient(routing="prefix_aware", block_size=16, prefill_queue_limit=512, idle_decode_prefill=True,
                          hold_tokens=2048)
        c.set_workers([WorkerEndpoint("p0", "prefill", "a:1"), WorkerEndpoint("d0", "decode", "a:2")])
        c.healthy = {"p0": True, "d0": True}
        routes = {}

        async def request(g):
            prompt = [g * 10000 + i for i in range(2000)]
            await c.held.wait(len(prompt))
            routes[g] = c.route(prompt)

        def where(g):
            return routes[g].prefill.worker_id if routes[g].prefill else "d0"

        tasks = [asyncio.create_task(request(g)) for g in range(8)]
        await asyncio.sleep(0.02)
        assert [where(g) for g in sorted(routes)] == ["d0", "p0", "p0", "d0"] and len(c.held) == 4
        for done, on, nxt in ((0, "d0", 4), (1, "p0", 5), (3, "d0", 6), (2, "p0", 7)):
            c.settle(routes[done], prefilled_remotely=on == "p0")  # that worker's prompt is done
            await asyncio.sleep(0.02)
            assert nxt in routes and where(nxt) == on, (done, {g: where(g) for g in routes})
            assert len(c.held) == 7 - nxt
        await asyncio.gather(*tasks)
        for r in routes.values():
            c.release(r)
        assert c.pending_prefill == {} and c.decode_streams == {}
    asyncio.run(main())


def test_a_router_without_holding_routes_every_prompt_at_once():
    async def main():
        c = ClusterClient(routing="prefix_aware", block_size=16, prefill_queue_limit=512)
        c.set_workers([WorkerEndpoint("p0", "prefill", "a:1"), WorkerEndpoint("d0", "decode", "a:2")])
        c.healthy = {"p0": True, "d0": True}
        c.stats = {"d0": pb.WorkerStats(running=FULL_DECODE_STREAMS)}
        for g in range(8):
            assert await c.held.wait(2000) == 0.0
            c.route([g * 10000 + i for i in range(2000)])
        assert len(c.held) == 0 and c.pending_prefill["p0"] >= 6 * 2000
    asyncio.run(main())


def test_held_prompts_go_to_the_decode_worker_when_the_prefill_pool_goes_down():
    """Prompts held behind a busy prefill worker are not stranded when it fails: the next poll
    (refresh marks it unhealthy, then wakes the held) lets them go, one by one, to the decode
    worker, which prefills them itself; every stream and pending token is released after."""
    async def main():
        c = ClusterClient(routing="prefix_aware", block_size=16, prefill_queue_limit=512, hold_tokens=1000)
        c.set_workers([WorkerEndpoint("p0", "prefill", "a:1"), WorkerEndpoint("d0", "decode", "a:2")])
        c.healthy = {"p0": True, "d0": True}
        c.stats = {"d0": pb.WorkerStats(running=FULL_DECODE_STREAMS)}  # full of streams: lends nothing
        routes = []

        async def request(g):
            await c.held.wait(600)
            routes.append(c.route([g * 10000 + i for i in range(600)]))

        tasks = [asyncio.create_task(request(g)) for g in range(4)]
        await asyncio.sleep(0.02)
        assert len(routes) == 2 and len(c.held) == 2  # 1,200 tokens queued on p0: the rest wait
        c.healthy["p0"] = False  # what refresh() finds, and then it wakes the held
        for _ in range(2):
            c.held.wake()
            await asyncio.sleep(0.02)
        await asyncio.wait_for(asyncio.gather(*tasks), 2)
        assert [r.prefill is None for r in routes[2:]] == [True, True]  # the decode worker prefills them
        for r in routes:
            c.release(r)
        assert c.pending_prefill == {} and c.decode_streams == {} and len(c.held) == 0
    asyncio.run(main())
