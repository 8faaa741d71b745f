"""KV cache events a block manager emits; the router's global prefix index consumes them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union


TIERS = ("device", "host", "disk")
"""Where a worker holds a block: its KV pool ("device"), or a tier under it (engine/kv/tiers.py)."""


@dataclass(frozen=True)
class BlockStored:
    seq: int
    block_hash: int
    parent_hash: int
    token_ids: tuple[int, ...]
    block_id: int
    tier: str = "device"


@dataclass(frozen=True)
class BlockRemoved:
    seq: int
    block_hash: int
    block_id: int
    tier: str = "device"


@dataclass(frozen=True)
class AllBlocksCleared:
    seq: int


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]
EventListener = Callable[[KVEvent], None]
