"""Background loops stop in bounded time, even when a cancellation is dropped on the way
(what kept a `pdserve worker` with a frozen Redis from ever exiting: its heartbeat loop went
on after `cancel()`, and `await task` waited forever)."""
import asyncio
import sys

import pytest

from pdserve.common.aio import stop_tasks


def loop_around_wait_for(pending: list) -> asyncio.Task:
    """A loop whose every step awaits `asyncio.wait_for` on a future the test completes."""
    async def body():
        while True:
            fut = asyncio.get_running_loop().create_future()
            pending.append(fut)
            await asyncio.wait_for(fut, 30)
    return asyncio.ensure_future(body())


async def cancel_as_the_call_finishes(task: asyncio.Task, pending: list) -> None:
    """The race: the awaited call completes in the same loop step as the cancel."""
    while not pending:
        await asyncio.sleep(0)
    pending[-1].set_result(None)
    task.cancel()


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="3.12 rewrote wait_for on asyncio.timeout")
def test_python311_wait_for_drops_a_cancel_that_races_its_result():
    async def main():
        pending = []
        task = loop_around_wait_for(pending)
        await cancel_as_the_call_finishes(task, pending)
        await asyncio.sleep(0.05)
        assert not task.done()  # the loop went on: one cancel() is not a stop
        assert len(pending) >= 2
        assert await stop_tasks(task, timeout_s=2.0)
    asyncio.run(main())


def test_stop_task_ends_a_loop_that_dropped_a_cancel():
    async def main():
        pending = []
        task = loop_around_wait_for(pending)
        await cancel_as_the_call_finishes(task, pending)
        t = asyncio.get_running_loop().time()
        assert await stop_tasks(task, timeout_s=5.0)
        assert task.cancelled()
        assert asyncio.get_running_loop().time() - t < 2.0
    asyncio.run(main())


def test_stop_task_gives_up_on_a_task_that_ignores_every_cancel(caplog):
    async def main():
        release = asyncio.Event()

        async def stubborn():
            while not release.is_set():
                try:
                    await asyncio.sleep(10)
                except asyncio.CancelledError:
                    pass
        task = asyncio.ensure_future(stubborn())
        task.set_name("stubborn")
        await asyncio.sleep(0)
        t = asyncio.get_running_loop().time()
        assert not await stop_tasks(task, timeout_s=0.5)  # bounded: returns, says so, does not hang
        assert 0.4 < asyncio.get_running_loop().time() - t < 3.0
        release.set()
        task.cancel()
        await asyncio.wait({task}, timeout=1)
    asyncio.run(main())
    assert "did not stop within 0.5s: stubborn" in caplog.text


def test_stop_task_on_nothing_or_a_finished_task():
    async def main():
        assert await stop_tasks(None)
        done = asyncio.ensure_future(asyncio.sleep(0))
        await done
        assert await stop_tasks(done)

        async def fails_later():
            await asyncio.sleep(0)
            raise RuntimeError("lost Redis")
        failed = asyncio.ensure_future(fails_later())
        await asyncio.wait({failed})
        assert await stop_tasks(failed)  # already ended on its own error: nothing to stop, not raised
        failed.exception()
    asyncio.run(main())


def test_tasks_are_cancelled_even_if_the_caller_never_waits():
    """A client hangs up: the handler running the cleanup is cancelled itself before its
    wait starts. Its pumps must be cancelled all the same, or they run on, unread."""
    async def main():
        pumps = [asyncio.ensure_future(asyncio.sleep(30)) for _ in range(3)]

        async def handler():
            try:
                await asyncio.sleep(30)
            finally:
                await stop_tasks(*pumps)
        h = asyncio.ensure_future(handler())
        await asyncio.sleep(0)
        h.cancel()
        await asyncio.sleep(0)
        h.cancel()  # cancelled again while in its cleanup
        await asyncio.wait({h}, timeout=1)
        await asyncio.wait(pumps, timeout=1)
        return [p.cancelled() for p in pumps]
    assert asyncio.run(main()) == [True, True, True]


def test_stop_tasks_waits_for_all_of_them():
    async def main():
        pending = [[], []]
        loops = [loop_around_wait_for(p) for p in pending]
        for task, p in zip(loops, pending):
            await cancel_as_the_call_finishes(task, p)
        assert await stop_tasks(*loops, timeout_s=5.0)
        return [t.cancelled() for t in loops]
    assert asyncio.run(main()) == [True, True]


def test_a_tasks_own_cleanup_on_cancel_is_not_cut_short():
    """A cancelled task that closes what it opened (streams, admission slots) gets to finish
    doing so: the next cancel comes only if it is still running a while later."""
    async def main():
        cleaned = []

        async def closes_on_cancel():
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                await asyncio.sleep(0.3)  # e.g. closing a gRPC stream
                cleaned.append(True)
                raise
        task = asyncio.ensure_future(closes_on_cancel())
        await asyncio.sleep(0)
        assert await stop_tasks(task, timeout_s=5.0)
        return cleaned
    assert asyncio.run(main()) == [True]
