"""What the router needs of the pools it runs beside (`pdserve up`): their sizes, and resizing
them. The admin endpoints (POST /admin/scale) and the autoscaler act through it; the Ray pools
of deploy/launch.py implement it. A router without pools (`pdserve router`) has none."""
from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class PoolControl(Protocol):
    pools: Mapping[str, object]
    """The pools by role ("prefill", "decode" or "aggregated")."""

    def sizes(self) -> dict[str, int]:
        """Workers per pool, by role."""

    def check(self, sizes: dict[str, int]) -> None:
        """Raise ValueError naming the first size this cluster cannot take."""

    async def scale(self, sizes: dict[str, int]) -> dict[str, int]:
        """Resize the pools (a removed worker drains first); returns the sizes reached."""


def scale_sizes(body: Any) -> dict[str, int]:
    """A scale request's body as {role: size}, checked for its shape (the pools check the
    roles and limits): a non-empty object of non-negative integers. JSON's `true` is not 1
    and `false` is not 0 (which would drain the pool); 2.0 is not 2."""
    if not isinstance(body, dict) or not body:
        raise ValueError('send {"prefill": N, "decode": M} (either or both)')
    for role, n in body.items():
        if type(n) is not int or n < 0:  # type(), not isinstance: bool is an int subclass
            raise ValueError(f"{role!r} must be a non-negative integer (workers), got {json.dumps(n)[:40]}")
    return body
