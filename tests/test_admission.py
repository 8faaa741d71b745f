"""The router's admission queue (router/admission.py): priority order, tenants in turn,
bounded, timed out, cancelled waiters gone, no place leaked."""
import asyncio

import pytest

from pdserve.router.admission import AdmissionQueue, QueueRefusal


def run(coro):
    return asyncio.run(coro)


async def settle():
    for _ in range(5):
        await asyncio.sleep(0)


def test_below_the_limit_nobody_waits():
    async def main():
        q = AdmissionQueue(limit=2)
        assert await q.enter(0, "a") == 0.0
        assert await q.enter(0, "b") == 0.0
        assert q.inflight == 2 and q.by_tenant == {"a": 1, "b": 1}
        q.leave("a")
        q.leave("b")
        assert q.inflight == 0 and q.by_tenant == {}
    run(main())


async def queue_up(q, clients):
    """Start one waiter per (name, priority, tenant), in order; returns (order admitted, tasks)."""
    order = []

    async def client(name, priority, tenant):
        await q.enter(priority, tenant)
        order.append((name, tenant))

    tasks = []
    for c in clients:
        tasks.append(asyncio.ensure_future(client(*c)))
        await settle()
    return order, tasks


async def serve_all(q, order, tasks, first_tenant):
    """Free the holder's place, then each admitted request's as it comes."""
    q.leave(first_tenant)
    for i in range(len(tasks)):
        await settle()
        q.leave(order[i][1])
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    return [n for n, _ in order]


def test_the_most_urgent_waiter_goes_first_then_the_tenant_admitted_least():
    async def main():
        q = AdmissionQueue(limit=1)
        await q.enter(0, "H")  # holds the only place
        order, tasks = await queue_up(q, [("A1", 5, "A"), ("A2", 5, "A"), ("B1", 5, "B"), ("urgent", -1, "C")])
        assert q.depth() == {5: 3, -1: 1}
        out = await serve_all(q, order, tasks, "H")
        assert q.inflight == 0 and q.by_tenant == {} and q.served == {}
        return out
    # A1 arrived first; then B (admitted nothing yet) before A's second
    assert run(main()) == ["urgent", "A1", "B1", "A2"]


def test_a_tenants_burst_does_not_hold_a_later_tenant_behind_it():
    """A queues 6 requests before B queues 2: B's are admitted in turn with A's, not after."""
    async def main():
        q = AdmissionQueue(limit=1)
        await q.enter(0, "A")
        order, tasks = await queue_up(q, [(f"A{i}", 0, "A") for i in range(6)] + [(f"B{i}", 0, "B") for i in range(2)])
        return await serve_all(q, order, tasks, "A")
    order = run(main())
    assert order.index("B0") <= 2 and order.index("B1") <= 4, order
    assert [n for n in order if n[0] == "A"] == [f"A{i}" for i in range(6)]  # FIFO within a tenant


def test_a_full_queue_refuses_the_least_urgent():
    async def main():
        q = AdmissionQueue(limit=1, max_waiting=2)
        await q.enter(0)
        low = [asyncio.ensure_future(q.enter(5, "x")) for _ in range(2)]
        await settle()
        with pytest.raises(QueueRefusal) as same:
            await q.enter(5, "y")  # no more urgent than those waiting: refused itself
        urgent = asyncio.ensure_future(q.enter(-1, "z"))
        await settle()
        done = [t for t in low if t.done()]
        assert len(done) == 1 and isinstance(done[0].exception(), QueueRefusal)  # the latest low one
        q.leave()
        await asyncio.wait_for(urgent, 5)
        assert not low[0].done()
        q.leave("z")
        await asyncio.wait_for(low[0], 5)
        q.leave("x")
        assert q.inflight == 0 and q.waiting == []
        return same.value.reason, done[0].exception().reason
    assert run(main()) == ("full", "full")


def test_a_waiter_times_out_and_one_whose_client_went_leaves_no_trace():
    async def main():
        q = AdmissionQueue(limit=1, timeout_s=0.05)
        await q.enter(0)
        with pytest.raises(QueueRefusal) as e:
            await q.enter(0)
        assert e.value.reason == "timeout" and q.waiting == []
        q.timeout_s = 60
        gone = asyncio.ensure_future(q.enter(0, "gone"))
        await settle()
        gone.cancel()
        await settle()
        assert q.waiting == [] and q.inflight == 1
        # cancelled in the same turn as it was admitted: its place comes back
        racing = asyncio.ensure_future(q.enter(0, "r"))
        await settle()
        q.leave()
        racing.cancel()
        await settle()
        assert q.inflight == 0 and q.by_tenant == {} and q.waiting == []
    run(main())


def test_a_request_takes_one_place_per_choice():
    async def main():
        q = AdmissionQueue(limit=4)
        await q.enter(0, "a", places=3)
        two = asyncio.ensure_future(q.enter(0, "b", places=2))
        await settle()
        assert not two.done()
        q.leave("a", 3)
        await asyncio.wait_for(two, 5)
        assert q.inflight == 2
        big = asyncio.ensure_future(q.enter(0, "c", places=9))  # larger than the limit: alone
        await settle()
        assert not big.done()
        q.leave("b", 2)
        await asyncio.wait_for(big, 5)
        q.leave("c", 9)
        assert q.inflight == 0
    run(main())
