"""KV cache events a block manager emits; the router's global prefix index consumes them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union


@dataclass(frozen=True)
class BlockStored:
    seq: int
    block_hash: int
    parent_hash: int
    token_ids: tuple[int, ...]
    block_id: int


@dataclass(frozen=True)
class BlockRemoved:
    seq: int
    block_hash: int
    block_id: int


@dataclass(frozen=True)
class AllBlocksCleared:
    seq: int


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]
EventListener = Callable[[KVEvent], None]
