"""The order waiting requests are admitted in: priority first (lower is served sooner, as
vLLM's `priority`), then, among the tenants of that priority, the tenant served least so far,
then arrival (a preempted request keeps its place at the front).

"Served" is a virtual token counter per tenant (VTC, Sheng et al., OSDI '24): every token the
engine computes for a tenant's request is charged to it, and a tenant that comes back after
an idle spell starts from the lowest counter among the tenants still active, so it cannot bank
credit while away. With one tenant this is arrival order within each priority.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

from pdserve.engine.core.request import Request


class WaitingQueue:
    def __init__(self):
        self._items: list[Request] = []  # arrival order (preempted ones put back at the front)
        self.served: dict[str, int] = {}
        """Tokens computed for each tenant (its virtual counter)."""

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items)

    def append(self, req: Request) -> None:
        self._items.append(req)

    def appendleft(self, req: Request) -> None:
        self._items.insert(0, req)

    def remove(self, req: Request) -> None:
        self._items.remove(req)

    def head(self) -> Request | None:
        """The request admitted next (None: empty)."""
        if not self._items:
            return None
        best = min(r.priority for r in self._items)
        first: dict[str, Request] = {}
        for r in self._items:
            if r.priority == best and r.tenant not in first:
                first[r.tenant] = r
        if len(first) == 1:
            return next(iter(first.values()))
        # the tenant served least; equal counters: whoever's request came first
        order = {id(r): i for i, r in enumerate(self._items)}
        return min(first.values(), key=lambda r: (self.served.get(r.tenant, 0), order[id(r)]))

    def pop_head(self) -> Request:
        req = self.head()
        self._items.remove(req)
        return req

    def charge(self, tenant: str, tokens: int) -> None:
        self.served[tenant] = self.served.get(tenant, 0) + tokens

    def arrive(self, tenant: str, active: Iterable[str]) -> None:
        """`tenant` has a request again; `active`: the tenants with requests here now (it not
        among them, or it is not coming back). Lifts its counter to the lowest active one."""
        floor = [self.served.get(t, 0) for t in set(active) if t != tenant]
        if floor:
            self.served[tenant] = max(self.served.get(tenant, 0), min(floor))

    def forget_idle(self, active: Iterable[str]) -> None:
        """Drop the counters of tenants with no request here (bounded memory); they are lifted
        again when they come back."""
        keep = set(active)
        if len(self.served) > 4 * max(len(keep), 64):
            self.served = {t: v for t, v in self.served.items() if t in keep}
