"""KV events: each worker appends its block manager's events to the stream
`pdserve:<cluster>:events:<id>`; routers follow every stream into their prefix index. A lost
event (Redis down, stream trimmed) shows up as a sequence gap, and the router resyncs that
worker from a snapshot; Redis being unreachable never stops a worker."""
from __future__ import annotations

import asyncio
import collections
import logging
import threading

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from pdserve.common.aio import stop_tasks
from pdserve.common.kv_events import TIERS, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

from .urls import connect, describe_error

log = logging.getLogger("pdserve.registry")


def events_key(cluster: str, worker_id: str) -> str:
    return f"pdserve:{cluster}:events:{worker_id}"


class EventPublisher:
    """Block-manager listener (called on the engine thread) that ships events to Redis."""

    def __init__(self, redis_url: str, cluster: str, worker_id: str, interval_s: float = 0.02,
                 maxlen: int = 200_000, max_buffer: int = 100_000):
        self.redis, self._url = connect(redis_url), redis_url
        self.key = events_key(cluster, worker_id)
        self.interval_s, self.maxlen = interval_s, maxlen
        self._buf: collections.deque = collections.deque(maxlen=max_buffer)  # overflow drops: a gap
        self._lock = threading.Lock()
        self._task: asyncio.Task | None = None
        self.published = self.dropped = 0

    def __call__(self, event: KVEvent) -> None:
        with self._lock:
            self._buf.append(event)

    @staticmethod
    def encode(e: KVEvent) -> dict:
        tier = {"tier": e.tier} if getattr(e, "tier", "device") != "device" else {}
        if isinstance(e, BlockStored):
            return {"seq": e.seq, "type": "stored", "hash": e.block_hash, "parent": e.parent_hash} | tier
        if isinstance(e, BlockRemoved):
            return {"seq": e.seq, "type": "removed", "hash": e.block_hash} | tier
        return {"seq": e.seq, "type": "cleared"}

    async def flush(self) -> None:
        with self._lock:
            batch = list(self._buf)
            self._buf.clear()
        if not batch:
            return
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for e in batch:
                    pipe.xadd(self.key, self.encode(e), maxlen=self.maxlen, approximate=True)
                await pipe.execute()
            self.published += len(batch)
        except (RedisError, OSError) as e:
            self.dropped += len(batch)  # routers see the gap and resync
            log.warning("dropped %d KV events: %s", len(batch), describe_error(e, self._url))

    async def _loop(self) -> None:
        while True:
            await self.flush()
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._loop())

    async def reset_stream(self) -> None:
        """A fresh start: drop an older incarnation's events."""
        try:
            await self.redis.delete(self.key)
        except (RedisError, OSError):
            pass

    async def stop(self) -> None:
        await stop_tasks(self._task)
        await self.flush()
        await self.redis.aclose()


def decode_event(fields: dict) -> KVEvent:
    """A stream entry as a KVEvent; ValueError when it is not one of ours (a sequence number
    and block hashes in [0, 2**64), a known type)."""
    try:
        f = {k.decode() if isinstance(k, bytes) else k: v.decode() if isinstance(v, bytes) else v
             for k, v in fields.items()}
        seq, kind = int(f["seq"]), f["type"]
        numbers = [seq] + [int(f[k]) for k in ("hash", "parent") if k in f]
    except (KeyError, ValueError, UnicodeDecodeError, AttributeError) as e:
        raise ValueError(f"not a KV event: {e!r}") from None
    if not all(0 <= n < 2**64 for n in numbers):
        raise ValueError("not a KV event: numbers outside [0, 2**64)")
    tier = f.get("tier", "device")
    if tier not in TIERS:
        raise ValueError(f"not a KV event: tier {tier!r}")
    if kind == "stored" and "hash" in f:
        return BlockStored(seq, int(f["hash"]), int(f.get("parent", 0)), (), -1, tier)
    if kind == "removed" and "hash" in f:
        return BlockRemoved(seq, int(f["hash"]), -1, tier)
    if kind == "cleared":
        return AllBlocksCleared(seq)
    raise ValueError(f"not a KV event: type {kind!r}")


class EventFollower:
    """Router side: reads every worker's event stream into a PrefixIndex."""

    def __init__(self, redis: aioredis.Redis, cluster: str, index):
        self.redis, self.cluster, self.index = redis, cluster, index
        self._last_id: dict[str, bytes | str] = {}
        self.malformed = 0  # stream entries skipped: not KV events

    def rewind(self, worker_id: str) -> None:
        """Re-read a worker's stream from its start (after a resync, events newer than the
        snapshot are applied again; older ones are skipped by sequence number)."""
        self._last_id.pop(worker_id, None)

    async def poll(self, worker_ids: list[str], count: int = 5000) -> int:
        """Apply what arrived since the last poll; returns the number of events applied."""
        for wid in list(self._last_id):
            if wid not in worker_ids:
                del self._last_id[wid]
        if not worker_ids:
            return 0
        owner = {events_key(self.cluster, w): w for w in worker_ids}  # ids may hold ":" too
        streams = {key: self._last_id.get(w, "0") for key, w in owner.items()}
        applied = 0
        for key, entries in await self.redis.xread(streams, count=count):
            wid = owner[key.decode() if isinstance(key, bytes) else key]
            for entry_id, fields in entries:
                self._last_id[wid] = entry_id
                try:
                    event = decode_event(fields)
                except ValueError as e:
                    self.malformed += 1
                    log.warning("skipped a malformed entry of %s's KV events: %s", wid, e)
                    continue
                self.index.apply(wid, event)
                applied += 1
        return applied
