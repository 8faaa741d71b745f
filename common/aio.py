"""Stopping background asyncio tasks in bounded time, and cleanups that a cancellation cannot cut short."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable

log = logging.getLogger("pdserve")
RECANCEL_S = 1.0


def stop_tasks(*tasks: asyncio.Task | None, timeout_s: float = 5.0) -> Awaitable[bool]:
    """Cancel tasks (background loops, pumps) now, and return what to await for them to end:
    at most `timeout_s`, True if all did. `None`s and finished tasks are skipped.

    The cancel happens in this call, not when the result is awaited: a caller that is itself
    being cancelled (a client hung up) may never get to run that await.

    One `cancel()` is not always enough. On Python 3.11, `asyncio.wait_for` (redis-py wraps
    socket writes in it) returns the inner call's result and drops a cancellation that lands
    in the same loop step as that call finishing; a loop around it then simply goes on, and a
    plain `cancel(); await task` waits forever (a worker that never stopped on Ctrl-C while
    its heartbeat kept running). So the wait cancels again, every `RECANCEL_S`, until the tasks
    are done: late enough not to cut short the cleanup a task runs when cancelled (closing
    streams takes milliseconds), soon enough that a stop is not held up for long."""
    live = [t for t in tasks if t is not None and not t.done()]
    for t in live:
        t.cancel()
    return _until_done(live, timeout_s)


async def _until_done(tasks: list[asyncio.Task], timeout_s: float) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        pending = [t for t in tasks if not t.done()]
        if not pending:
            break
        left = deadline - loop.time()
        if left <= 0:
            log.warning("background tasks did not stop within %.1fs: %s", timeout_s,
                        ", ".join(t.get_name() for t in pending))
            return False
        await asyncio.wait(pending, timeout=min(RECANCEL_S, left))
        for t in pending:
            t.cancel()  # a no-op on tasks that ended; again on those that dropped it
    for t in tasks:
        if not t.cancelled() and t.exception() is not None:
            log.warning("background task %s ended with %r", t.get_name(), t.exception())
    return True


_detached: set[asyncio.Task] = set()  # held: the loop keeps only weak references to tasks


def detached(cleanup: Awaitable) -> Awaitable:
    """Run `cleanup` to its end in a task of its own; return what to await for it, shielded.

    A cleanup awaited by a task that is being cancelled is cut short at its first await once
    the cancel is repeated, and anyio repeats it at every await inside a cancelled scope
    (Starlette cancels a streaming response that way when its client hangs up). Awaiting the
    shield may still raise CancelledError; the cleanup runs on regardless."""
    task = asyncio.ensure_future(cleanup)
    _detached.add(task)
    task.add_done_callback(_detached.discard)
    return asyncio.shield(task)
