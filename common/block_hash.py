"""Chained block hashes: the identity of a KV block's content.

hash(block i) = H(hash(block i-1), namespace, tokens of block i). Equal hashes mean equal
token prefixes (up to and including the block) under the same namespace, so a block can be
shared. The router computes the same function in another process, so it uses a fixed byte
encoding and a keyed-free stable digest (never Python's randomized `hash`).
"""
from __future__ import annotations

import hashlib
import struct
from typing import Sequence

ROOT_HASH = 0


def hash_block(parent: int, tokens: Sequence[int], namespace: str = "") -> int:
    """64-bit hash of one full block given its parent's hash (ROOT_HASH for the first)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack("<Q", parent))
    h.update(namespace.encode())
    h.update(b"\x00")
    h.update(struct.pack(f"<{len(tokens)}I", *tokens))
    return int.from_bytes(h.digest(), "little")


def root_hash(cache_salt: str = "", lora: str = "") -> int:
    """The parent hash of a prompt's first block. A request's cache salt (tenant isolation)
    changes it, so its whole chain: prompts with different salts share no block, and a
    tenant cannot learn from its cache hits (TTFT) what another one sent. So does its LoRA
    adapter's identity (`LoRAAdapter.identity`: name and weights digest): KV computed under
    an adapter differs from the base's and another adapter's, so they share no block either.
    The base model with no salt keeps ROOT_HASH."""
    if not lora:
        if not cache_salt:
            return ROOT_HASH
        h = hashlib.blake2b(b"pdserve cache salt\x00" + cache_salt.encode(), digest_size=8)
        return int.from_bytes(h.digest(), "little")
    # its own prefix (never a salt-only input) and the salt's length, so no salt and adapter
    # pair reads as another
    salt = cache_salt.encode()
    h = hashlib.blake2b(b"pdserve cache salt+lora\x00" + struct.pack("<Q", len(salt)) + salt + lora.encode(),
                        digest_size=8)
    return int.from_bytes(h.digest(), "little")


def hash_blocks(tokens: Sequence[int], block_size: int, namespace: str = "",
                start: int = 0, parent: int = ROOT_HASH) -> list[int]:
    """Hashes of the full blocks of `tokens`, from block index `start` (whose parent hash is
    `parent`) onwards. A trailing partial block has no hash."""
    out = []
    for b in range(start, len(tokens) // block_size):
        parent = hash_block(parent, tokens[b * block_size:(b + 1) * block_size], namespace)
        out.append(parent)
    return out
