"""The router's own queue: at most `limit` generations in flight; past it a request waits,
the most urgent first, instead of being refused.

Order among the waiting: lower priority first (vLLM's `priority`); within one priority the
tenant admitted least so far first (a virtual counter per tenant, as in VTC: a tenant that
comes back starts level with the least served tenant present, not with its old credit), so
one tenant's burst cannot hold the others' requests behind it; then arrival. A request needs one place per choice (`n`). The
queue is bounded: when it is full, a request more urgent than the least urgent waiting one
takes that one's place (which is refused), else it is refused itself; a request that waits
longer than `timeout_s` is refused. A waiter whose client goes (its task cancelled) leaves the
queue at once: nothing is started for it. Pure asyncio, no I/O: tested without a network.
"""
from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field


class QueueRefusal(Exception):
    """The request was not admitted: `reason` is `full` (the queue is full of requests at
    least as urgent) or `timeout` (it waited `timeout_s`)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass
class _Waiter:
    priority: int
    tenant: str
    places: int
    seq: int
    future: asyncio.Future = field(repr=False)


class AdmissionQueue:
    def __init__(self, limit: int, max_waiting: int = 1024, timeout_s: float = 60.0):
        """`limit`: generations in flight at most (0: no limit, nobody waits); `max_waiting`:
        requests waiting at most (0: none wait, a request past the limit is refused at once)."""
        self.limit, self.max_waiting, self.timeout_s = limit, max_waiting, timeout_s
        self.inflight = 0
        self.by_tenant: dict[str, int] = {}  # places in flight
        self.served: dict[str, int] = {}  # places admitted, of tenants in flight or waiting
        self.waiting: list[_Waiter] = []
        self._seq = itertools.count()

    def _fits(self, places: int) -> bool:
        # a request larger than the whole limit goes alone rather than never
        return not self.limit or self.inflight + places <= self.limit or self.inflight == 0

    def _take(self, tenant: str, places: int) -> None:
        self._arrive(tenant)
        self.inflight += places
        self.by_tenant[tenant] = self.by_tenant.get(tenant, 0) + places
        self.served[tenant] += places

    def _arrive(self, tenant: str) -> None:
        if tenant not in self.served:
            self.served[tenant] = min(self.served.values(), default=0)

    def _prune(self, tenant: str) -> None:
        if tenant not in self.by_tenant and all(w.tenant != tenant for w in self.waiting):
            self.served.pop(tenant, None)

    async def enter(self, priority: int = 0, tenant: str = "", places: int = 1) -> float:
        """Wait for `places` places; returns the seconds waited. Raises QueueRefusal."""
        if not self.waiting and self._fits(places):
            self._take(tenant, places)
            return 0.0
        loop = asyncio.get_running_loop()
        me = _Waiter(priority, tenant, places, next(self._seq), loop.create_future())
        if len(self.waiting) >= self.max_waiting:
            worst = max(self.waiting, key=lambda w: (w.priority, w.seq), default=None)
            if worst is None or worst.priority <= priority:
                raise QueueRefusal("full", f"the router's queue is full ({self.max_waiting} requests waiting)")
            self.waiting.remove(worst)
            worst.future.set_exception(QueueRefusal(
                "full", "the router's queue is full and a more urgent request took this one's place"))
            self._prune(worst.tenant)
        self._arrive(tenant)
        self.waiting.append(me)
        t0 = loop.time()
        try:  # not wait_for: 3.11's returns the result of a future done as the cancel lands
            async with asyncio.timeout(self.timeout_s):
                await me.future
        except TimeoutError:
            self._forget(me)
            raise QueueRefusal("timeout", f"waited {self.timeout_s:g} s in the router's queue") from None
        except asyncio.CancelledError:
            self._forget(me)
            raise
        return loop.time() - t0

    def _forget(self, me: _Waiter) -> None:
        """A waiter that stopped waiting: out of the queue, or, if it was admitted meanwhile,
        its places given back."""
        if me in self.waiting:
            self.waiting.remove(me)
            self._prune(me.tenant)
        elif me.future.done() and not me.future.cancelled() and me.future.exception() is None:
            self.leave(me.tenant, me.places)
        if not me.future.done():
            me.future.cancel()

    def leave(self, tenant: str = "", places: int = 1) -> None:
        """`places` places of `tenant` are free again: admit who comes next."""
        self.inflight -= places
        left = self.by_tenant.get(tenant, 0) - places
        if left > 0:
            self.by_tenant[tenant] = left
        else:
            self.by_tenant.pop(tenant, None)
            self._prune(tenant)
        self._admit()

    def _admit(self) -> None:
        while self.waiting:
            nxt = min(self.waiting, key=lambda w: (w.priority, self.served[w.tenant], w.seq))
            if not self._fits(nxt.places):
                return
            self.waiting.remove(nxt)
            self._take(nxt.tenant, nxt.places)
            nxt.future.set_result(None)

    def depth(self) -> dict[int, int]:
        """Requests waiting, by priority."""
        out: dict[int, int] = {}
        for w in self.waiting:
            out[w.priority] = out.get(w.priority, 0) + 1
        return out
