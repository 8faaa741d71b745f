"""Stopping background asyncio loops in bounded time."""
from __future__ import annotations

import asyncio
import logging

log = logging.getLogger("pdserve")


async def stop_task(task: asyncio.Task | None, timeout_s: float = 5.0) -> bool:
    """Cancel a background loop and wait for it to end, at most `timeout_s`; True if it ended.

    One `cancel()` is not always enough. On Python 3.11, `asyncio.wait_for` (redis-py wraps
    socket writes in it) returns the inner call's result and drops a cancellation that lands
    in the same loop step as that call finishing; a loop around it then simply goes on, and a
    plain `cancel(); await task` waits forever (a worker that never stopped on Ctrl-C, while
    its heartbeat kept running). So this cancels again until the task is done."""
    if task is None or task.done():
        return True
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not task.done():
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            log.warning("background task %s did not stop within %.0fs", task.get_name(), timeout_s)
            return False
        task.cancel()
        await asyncio.wait({task}, timeout=min(0.2, left))
    if not task.cancelled() and task.exception() is not None:
        log.warning("background task %s ended with %r", task.get_name(), task.exception())
    return True
