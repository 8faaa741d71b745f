"""KV tiers under a worker's KV pool: evicted prefix blocks kept in host memory, then on disk.

When the block manager evicts a cached block (its KV is still intact: the block is only
being handed to a new owner), `TieredStore.store` copies that block's KV, in the cache's own
format, into the host tier, keyed by the block's content hash. When a prompt's prefix
continues past the blocks cached in the pool, `TieredStore.load` copies a kept block back into
a free pool block before the request runs, and the block manager counts it as a hit of that
tier. The host tier is an inclusive LRU bounded in bytes; what it drops goes to the disk tier
(when one is set), also an LRU bounded in bytes.

A disk entry is one file: a header (magic, the payload's length and its BLAKE2b digest), then
the block's bytes. It is written to a private temporary file, flushed to disk and renamed into
place, so a reader sees a whole file or none; a file whose length or digest does not match
(torn, truncated, overwritten) is deleted and counted, never read as KV. The directory is the
worker's own and is emptied when the store closes: block hashes name KV of this process's
model and cache format only.

On a GPU the pool is HBM and the host tier pinned host memory; on the CPU both are RAM, so
the host tier pays where the pool is bounded (`--kv-cache-memory`) below the working set.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import struct
import tempfile
from collections import OrderedDict
from pathlib import Path

import torch

MAGIC = b"PDKV1\0\0\0"
HEADER = struct.Struct("<8sQ32s")  # magic, payload bytes, blake2b-256 digest of the payload


class TierStats:
    """Counters of one tier: entries and bytes now, and what moved."""

    def __init__(self, name: str):
        self.name = name
        self.entries = self.bytes = 0
        self.stored = self.loaded = self.dropped = self.refused = 0


class TieredStore:
    """The host tier (and optionally the disk tier) of one KV cache. `kv`: the pool tensor
    (layers, 2, blocks, ...); one block's KV is `kv[:, :, bid]`. Runs on the engine thread."""

    def __init__(self, kv: torch.Tensor, host_bytes: int, disk_dir: str | None = None, disk_bytes: int = 0):
        self.kv = kv
        self.block_bytes = kv[:, :, 0].numel() * kv.element_size()
        self.host_capacity = host_bytes
        self._host: OrderedDict[int, torch.Tensor] = OrderedDict()
        self.host = TierStats("host")
        self.disk = TierStats("disk")
        self.disk_capacity = disk_bytes if disk_dir else 0
        self._disk: OrderedDict[int, Path] = OrderedDict()
        self._dir = Path(tempfile.mkdtemp(prefix="pdserve-kv-", dir=disk_dir)) if self.disk_capacity else None
        # on_change(hash, tier, held): a block entered (True) or left (False) a tier; the block
        # manager turns it into KV events, so the router's prefix index knows the tiers too
        self.on_change = lambda h, tier, held: None

    def has(self, h: int) -> bool:
        return h in self._host or h in self._disk

    def store(self, h: int, bid: int) -> None:
        """Keep block `bid`'s KV under hash `h` (the block is about to be reused)."""
        if h in self._host:
            self._host.move_to_end(h)
            return
        if self.block_bytes > self.host_capacity:
            self._to_disk(h, self.kv[:, :, bid])
            return
        self._host[h] = self.kv[:, :, bid].clone()
        self.host.stored += 1
        self.on_change(h, "host", True)
        self._account_host()
        while len(self._host) * self.block_bytes > self.host_capacity:
            old, data = self._host.popitem(last=False)
            self.host.dropped += 1
            self.on_change(old, "host", False)
            if old not in self._disk:
                self._to_disk(old, data)
            self._account_host()

    def load(self, h: int, bid: int) -> str | None:
        """Copy the KV kept under `h` into pool block `bid`; returns the tier it came from,
        or None when it is not kept (or its disk entry failed its check and was dropped)."""
        data = self._host.get(h)
        if data is not None:
            self._host.move_to_end(h)
            self.kv[:, :, bid] = data
            self.host.loaded += 1
            return "host"
        data = self._from_disk(h)
        if data is None:
            return None
        self.kv[:, :, bid] = data
        self.disk.loaded += 1
        return "disk"

    def peek(self, h: int) -> torch.Tensor | None:
        """The KV kept under `h` (host tier, else disk), without moving it into the pool: a
        peer pulling the block gets a copy. None when it is not kept, or its disk entry failed
        its check (dropped as in `load`)."""
        data = self._host.get(h)
        return data if data is not None else self._from_disk(h)

    def _account_host(self) -> None:
        self.host.entries, self.host.bytes = len(self._host), len(self._host) * self.block_bytes

    # ---- disk ------------------------------------------------------------------------
    def _path(self, h: int) -> Path:
        return self._dir / f"{h & (2**64 - 1):016x}.kv"

    def _to_disk(self, h: int, data: torch.Tensor) -> None:
        if self._dir is None or self.block_bytes > self.disk_capacity:
            return
        payload = data.contiguous().view(torch.uint8).numpy().tobytes()
        fd, tmp = tempfile.mkstemp(dir=self._dir, suffix=".part")
        with os.fdopen(fd, "wb") as f:
            f.write(HEADER.pack(MAGIC, len(payload), hashlib.blake2b(payload, digest_size=32).digest()))
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._path(h))  # atomic: a reader sees the whole file or the old one
        self._disk[h] = self._path(h)
        self.disk.stored += 1
        self.on_change(h, "disk", True)
        while len(self._disk) * self.block_bytes > self.disk_capacity:
            old, path = self._disk.popitem(last=False)
            path.unlink(missing_ok=True)
            self.disk.dropped += 1
            self.on_change(old, "disk", False)
        self.disk.entries, self.disk.bytes = len(self._disk), len(self._disk) * self.block_bytes

    def _from_disk(self, h: int) -> torch.Tensor | None:
        path = self._disk.get(h)
        if path is None:
            return None
        try:
            raw = path.read_bytes()
        except OSError:
            raw = b""
        magic, n, digest = HEADER.unpack_from(raw) if len(raw) >= HEADER.size else (b"", -1, b"")
        payload = raw[HEADER.size:]
        if magic != MAGIC or n != len(payload) or n != self.block_bytes \
                or hashlib.blake2b(payload, digest_size=32).digest() != digest:
            self._forget_disk(h)
            self.disk.refused += 1
            return None
        self._disk.move_to_end(h)
        flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        return flat.view(self.kv.dtype).view(self.kv[:, :, 0].shape)

    def _forget_disk(self, h: int) -> None:
        path = self._disk.pop(h, None)
        if path is not None:
            path.unlink(missing_ok=True)
            self.on_change(h, "disk", False)
        self.disk.entries, self.disk.bytes = len(self._disk), len(self._disk) * self.block_bytes

    def clear(self) -> None:
        """Drop every entry of both tiers (silently: the caller announces it, or stops)."""
        self._host.clear()
        self._account_host()
        for path in self._disk.values():
            path.unlink(missing_ok=True)
        self._disk.clear()
        self.disk.entries = self.disk.bytes = 0

    def close(self) -> None:
        """Drop every entry and remove the disk tier's directory."""
        self.clear()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


def host_tier_bytes(setting: int) -> int:
    """The host tier's size for CacheConfig.kv_host_memory (-1: a quarter of the memory
    available now, at most 8 GiB)."""
    if setting >= 0:
        return setting
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return 0
    return min(avail // 4, 8 << 30)


def kv_tiers(cache, kv: torch.Tensor) -> TieredStore | None:
    """The tiers `cache` (a CacheConfig) asks for under the pool `kv`, or None."""
    host = host_tier_bytes(cache.kv_host_memory)
    if not cache.enable_prefix_caching or (host <= 0 and cache.kv_disk_memory <= 0):
        return None
    return TieredStore(kv, host, cache.kv_disk_dir or None, cache.kv_disk_memory)


def tier_stats(blocks) -> dict[str, int]:
    """EngineStats' tier fields of a block manager."""
    t = blocks.tiers
    if t is None:
        return {}
    return {"kv_host_bytes": t.host.bytes, "kv_disk_bytes": t.disk.bytes,
            "kv_host_hits": blocks.tier_hits.get("host", 0), "kv_disk_hits": blocks.tier_hits.get("disk", 0),
            "kv_host_stored": t.host.stored, "kv_disk_stored": t.disk.stored, "kv_disk_refused": t.disk.refused}
