"""Prompts held in the router while every place to compute them is busy (late binding).

A prompt routed at once is bound to a worker's queue at its arrival: a burst of long prompts
then splits between the prefill worker and its decode worker by the loads at that instant, and
whichever finishes its share first idles while the other's queue still runs (on 2 cores, 8
~2,000-token prompts: the decode worker done at 11 s, the prefill worker's queue at 18 s). So
while the prefill pool has a full queue (`hold_tokens`) and no decode worker would take the
prompt (`policies.prefill_on_decode`), the router holds it, most urgent first, then by
arrival, and lets one go each time a place opens: a prompt settles (its first token), a stream
ends, a stats poll comes in. Each worker so keeps a queue of about `hold_tokens` and the rest
goes to whichever frees first. A request more urgent than the default, or more urgent than
every stream on some decode worker, is never held (it has its own placement); none waits past
`HOLD_MAX_S` (it is then routed as it would have been at once).
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
from typing import Callable

from .policies import WorkerLoad, prefill_on_decode

HOLD_MAX_S = 30.0


def must_hold(prefill: list[WorkerLoad], decode: list[WorkerLoad], todo: int, limit: int,
              idle_decode_prefill: bool, hold_tokens: int) -> bool:
    """Would the prompt (`todo` tokens) wait in a queue wherever it went? Yes when lending is on
    (`limit` > 0) and holding (`hold_tokens` > 0), every healthy prefill worker has at least
    max(limit, hold_tokens) tokens queued, and no healthy decode worker would prefill it now
    (by `prefill_on_decode`, against the shortest prefill queue). The default, 2,048 tokens
    (RouterConfig.hold_tokens), is about 2 s of prefill on one core of the 2-core CPU of
    bench/NOTES.md: several full steps, so a prefill worker never waits for the router."""
    ready = [w for w in prefill if w.healthy]
    if limit <= 0 or hold_tokens <= 0 or not ready:
        return False
    backlog = min(w.queued_prefill_tokens for w in ready)
    if backlog < max(limit, hold_tokens):
        return False
    return not any(prefill_on_decode(backlog, d.queued_prefill_tokens, todo, limit,
                                     idle_decode_prefill and d.running == 0 and d.queued_prefill_tokens == 0,
                                     d.running)
                   for d in decode if d.healthy)


class HeldPrompts:
    """The router's held prompts: `wait` holds one while `hold(todo, priority)` says so, `wake`
    lets the first go once it no longer does (the router calls it whenever its loads change:
    a route, a settled prompt, a stream's end, a stats poll)."""

    def __init__(self, hold: Callable[[int, int], bool], max_s: float = HOLD_MAX_S):
        """`hold(todo, priority)`: whether a prompt must wait now; `on_hold`, settable: called
        once for each prompt held (the router's counter)."""
        self._hold = hold
        self.max_s = max_s
        self._heap: list[tuple[int, int, int, asyncio.Future]] = []
        self._seq = itertools.count()
        self.on_hold: Callable[[], None] = lambda: None

    def __len__(self) -> int:
        return sum(not f.done() for *_, f in self._heap)

    async def wait(self, todo: int, priority: int = 0) -> float:
        """Return when the prompt may be routed: at once if it need not be held and no held
        prompt at least as urgent waits before it; else when `wake` lets it go, or after
        `max_s`. The seconds held."""
        if priority < 0 or not self._hold(todo, priority) and not self._ahead(priority):
            return 0.0
        loop = asyncio.get_running_loop()
        fut, start = loop.create_future(), loop.time()
        heapq.heappush(self._heap, (priority, next(self._seq), todo, fut))
        self.on_hold()
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.max_s)
        except asyncio.TimeoutError:
            pass
        finally:
            if not fut.done():  # timed out, or its client left: the next may go now
                fut.cancel()
                self.wake()
        return loop.time() - start

    def _ahead(self, priority: int) -> bool:
        self._drop_done()
        return bool(self._heap) and self._heap[0][0] <= priority

    def _drop_done(self) -> None:
        while self._heap and self._heap[0][3].done():
            heapq.heappop(self._heap)

    def wake(self) -> None:
        """Let the first held prompt go if it need not be held any more (one at a time: its
        route changes the loads the next one is judged by)."""
        self._drop_done()
        if self._heap and not self._hold(self._heap[0][2], self._heap[0][0]):
            heapq.heappop(self._heap)[3].set_result(None)
