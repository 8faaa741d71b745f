"""What the router needs of the pools it runs beside (`pdserve up`): their sizes, and resizing
them. The admin endpoints (POST /admin/scale) and the autoscaler act through it; the Ray pools
of deploy/launch.py implement it. A router without pools (`pdserve router`) has none."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable


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
