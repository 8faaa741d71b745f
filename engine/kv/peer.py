"""An engine's KV blocks by content hash, for peer prefix pulls (kv_transfer/peer.py).

The peer side: `export_by_hash` copies the leading run of the wanted blocks that this engine
holds, in its pool or a tier under it. The puller side: `reserve_pull` takes the blocks the
pulled KV lands in (owned by a pseudo-request, `PullSlot.owner`, so nothing evicts or reuses
them meanwhile), `install_pull` writes the KV, caches the blocks under the hashes computed
here from the prompt and releases them to the free queue as cached prefix blocks (the
request that follows finds them as a prefix hit), `cancel_pull` releases them uncached.
Every function runs on the engine thread (`AsyncEngine.run`); none keeps state.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.common.block_hash import hash_blocks

PULL_OWNER = "peer-pull:"
"""Prefix of the block-manager owner that holds a pull's blocks (beside the request's own id)."""


@dataclass(frozen=True)
class PullSlot:
    """Blocks reserved for a pull: `dest_block_ids` await the KV of the blocks hashed
    `hashes`, which follow the `first_block` blocks this engine already caches."""

    owner: str
    first_block: int
    hashes: tuple[int, ...]
    dest_block_ids: tuple[int, ...]


def export_by_hash(e, hashes: list[int]) -> tuple[list[int], torch.Tensor | None]:
    """The leading blocks of `hashes` that engine `e` holds (pool, else host or disk tier) and
    a copy of their KV on the CPU, (layers, 2, k, block_size, n_kv_heads, row_width); ([],
    None) when it holds the first one nowhere. Runs between steps, so the pool's blocks
    cannot change while they are copied."""
    blocks, parts, found = e.blocks, [], []
    if e.tp is not None:  # a tensor-parallel group's ranks each hold a slice of every block
        return [], None
    for h in hashes:
        bid = blocks.cached_block(h)
        data = e.kv_cache.kv[:, :, bid] if bid is not None else (
            blocks.tiers.peek(h) if blocks.tiers is not None else None)
        if data is None:
            break
        parts.append(data.to("cpu"))
        found.append(h)
    if not parts:
        return [], None
    return found, torch.stack(parts, dim=2)  # a copy: the pool may change once this returns


def reserve_pull(e, request_id: str, prompt: list[int], root: int, peer_blocks: int) -> PullSlot | None:
    """Blocks for the KV of the prompt's leading `peer_blocks` blocks that engine `e` does not
    cache (its own cached prefix is shared, not pulled), or None: nothing to pull (it caches
    as much already, a tensor-parallel group, no prefix caching) or not enough free blocks
    for them and the rest of the prompt (a pull must not preempt the batch)."""
    blocks = e.blocks
    if e.tp is not None or not blocks.enable_caching:
        return None
    bs = blocks.block_size
    want = min(peer_blocks, (len(prompt) - 1) // bs)  # the last token is always computed
    local = blocks.match_prefix(prompt, count=False, root=root)
    have = len(local.block_ids)
    if want <= have or blocks.blocks_needed("", len(prompt), local) > blocks.num_free_blocks:
        return None
    owner = PULL_OWNER + request_id
    if not blocks.allocate(owner, want * bs, local):
        return None
    hashes = hash_blocks(prompt[:want * bs], bs, blocks.namespace, parent=root)
    return PullSlot(owner, have, tuple(hashes[have:]), tuple(blocks.block_table(owner)[have:want]))


def install_pull(e, slot: PullSlot, kv: torch.Tensor, prompt: list[int], root: int) -> int:
    """Write the pulled KV (the first kv.shape[2] blocks of `slot`, checked against its hashes
    by the receiver) into its blocks, cache them under the hashes this engine computes from
    `prompt` and release them; returns the blocks installed. A block whose hash another
    request cached meanwhile is released uncached (the cache keeps one block per hash)."""
    n = kv.shape[2]
    assert 0 < n <= len(slot.dest_block_ids)
    blocks = e.blocks
    try:
        e.kv_cache.import_blocks(list(slot.dest_block_ids[:n]), kv)
        blocks.cache_full_blocks(slot.owner, prompt, (slot.first_block + n) * blocks.block_size, root)
    finally:
        blocks.free(slot.owner)
    return n


def cancel_pull(e, slot: PullSlot) -> None:
    """Release a pull's blocks, uncached (nothing was installed): back in the free queue."""
    e.blocks.free(slot.owner)


def block_bytes(e) -> int:
    """Bytes of one block's KV in engine `e`'s cache (what a pull moves per block)."""
    return e.kv_cache.bytes_per_block
