"""Cluster membership and KV events in Redis.

- Registry: each worker keeps `pdserve:<cluster>:worker:<id>` (JSON, with a TTL) alive by
  heartbeat; a worker that dies simply expires. Routers list the keys.
- KV events: each worker appends its block manager's events to the stream
  `pdserve:<cluster>:events:<id>`; routers follow every stream into their prefix index. A
  lost event (Redis down, stream trimmed) shows up as a sequence gap, and the router
  resyncs that worker from a snapshot.
Redis being unreachable never stops a worker: heartbeats and events retry, and the gap
mechanism repairs the index afterwards.

Redis URLs go to `redis.asyncio.from_url` unchanged, so `redis://:PASSWORD@host:6379/0`,
`redis://USER:PASSWORD@...` (ACL users) and TLS (`rediss://...?ssl_cert_reqs=required&
ssl_ca_certs=/path/ca.pem`) all work; special characters in a password must be
percent-encoded. A URL is only ever logged through `redact_url`, and Redis errors through
`describe_error`, so that a password never reaches a log.
"""
from __future__ import annotations

import asyncio
import collections
import json
import logging
import re
import threading
from dataclasses import asdict, dataclass
from urllib.parse import unquote, unquote_plus

import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError, RedisError

from pdserve.engine.aio import stop_tasks
from pdserve.engine.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

log = logging.getLogger("pdserve.registry")

REDACTED = "***"
# query parameters whose values are secrets (e.g. `ssl_password`, the key file's passphrase);
# paths such as ssl_keyfile/ssl_ca_certs are not
_SENSITIVE_QUERY = ("pass", "secret", "token", "auth")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)(.*)$", re.S)


def _split_url(url: str) -> tuple[str, str | None, str]:
    """(scheme://, userinfo or None, the rest). The userinfo ends at the *last* '@', as in
    urllib, but the authority is not cut at '/', '?' or '#' first: a password with one of
    those unencoded is then still hidden whole (at worst the host is hidden too)."""
    m = _SCHEME.match(url)
    prefix, rest = (m.group(1), m.group(2)) if m else ("", url)
    userinfo, at, host = rest.rpartition("@")
    return (prefix, userinfo, host) if at else (prefix, None, rest)


def _sensitive(name: str) -> bool:
    return any(s in unquote_plus(name).lower() for s in _SENSITIVE_QUERY)


def redact_url(url: str) -> str:
    """`url` fit for a log line or an error message: the password (and secret-looking query
    values) become `***`; scheme, user name, host, port, db and other parameters stay.
    `redis://user:pw@h:6379/0` -> `redis://user:***@h:6379/0`. A user part without a ':'
    is hidden whole: people write `redis://PASSWORD@host` meaning a password."""
    prefix, userinfo, rest = _split_url(url)
    if userinfo is not None:
        user, colon, _ = userinfo.partition(":")
        rest = (f"{user}:{REDACTED}@" if colon else f"{REDACTED}@") + rest
    base, q, query = rest.partition("?")
    if q:
        query, hashmark, fragment = query.partition("#")
        parts = []
        for item in query.split("&"):
            name, eq, _ = item.partition("=")
            parts.append(f"{name}={REDACTED}" if eq and _sensitive(name) else item)
        rest = base + "?" + "&".join(parts) + hashmark + fragment
    return prefix + rest


def url_secrets(url: str) -> set[str]:
    """The secrets in a URL, as written and decoded: its password and secret query values."""
    _, userinfo, rest = _split_url(url)
    found: set[str] = set()
    if userinfo is not None:
        user, colon, password = userinfo.partition(":")
        found |= {password if colon else user}
    query = rest.partition("?")[2].partition("#")[0]
    for item in query.split("&") if query else ():
        name, eq, value = item.partition("=")
        if eq and _sensitive(name):
            found |= {value, unquote_plus(value)}
    # decoded too; and the pieces between URL delimiters, which is what urllib quotes in
    # its errors when a password has them unencoded
    found |= {unquote(s) for s in found}
    found |= {piece for s in found for piece in re.split(r"[/?#@:&=]", s)}
    return {s for s in found if s}


def redact_secrets(text, url: str) -> str:
    """str(text) with every secret of `url` replaced by `***`: for Redis errors in log lines
    (redis-py's messages carry host:port only, but a server reply or a future message might
    echo more; this makes sure)."""
    out = str(text)
    for s in sorted(url_secrets(url), key=len, reverse=True):
        out = out.replace(s, REDACTED)
    return out


def describe_error(e: BaseException, redis_url: str) -> str:
    """A Redis error for a log line: secrets of the URL removed, and a hint when the server
    refused our credentials (redis-py's wording, e.g. about HELLO, does not say so plainly)."""
    text = redact_secrets(e, redis_url)
    if isinstance(e, AuthenticationError) or "NOAUTH" in text or "WRONGPASS" in text:
        text += " (Redis authentication failed: check the password in the Redis URL)"
    return text


def connect(redis_url: str, timeout_s: float = 5.0) -> aioredis.Redis:
    """`redis.asyncio.from_url`, with a malformed URL reported without its password (urllib's
    own errors can quote part of it, e.g. an unencoded '/' makes the rest a 'port').
    Every command gives up after `timeout_s` (redis-py waits forever by default): a registry
    behind a partition, which drops packets rather than refusing them, must not stall a
    heartbeat, the router's sync, or a worker's shutdown."""
    try:
        return aioredis.from_url(redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    except ValueError as e:
        raise ValueError(f"invalid Redis URL {redact_url(redis_url)!r}: {redact_secrets(e, redis_url)} "
                         "(percent-encode special characters in the password)") from None


def worker_key(cluster: str, worker_id: str) -> str:
    return f"pdserve:{cluster}:worker:{worker_id}"


def events_key(cluster: str, worker_id: str) -> str:
    return f"pdserve:{cluster}:events:{worker_id}"


@dataclass(frozen=True)
class WorkerRecord:
    worker_id: str
    role: str          # "prefill" | "decode" | "aggregated"
    address: str       # gRPC service
    kv_address: str = ""
    incarnation: str = ""  # differs on every start: a restarted worker's events start again at 1


class WorkerRegistration:
    """Keeps one worker's registry key alive while it runs."""

    def __init__(self, redis_url: str, cluster: str, record: WorkerRecord, ttl_s: float = 5.0, interval_s: float = 1.0):
        self.redis, self._url = connect(redis_url), redis_url
        self.key, self.record = worker_key(cluster, record.worker_id), record
        self.ttl_ms, self.interval_s = int(ttl_s * 1000), interval_s
        self._task: asyncio.Task | None = None

    async def beat(self) -> bool:
        try:
            await self.redis.set(self.key, json.dumps(asdict(self.record)), px=self.ttl_ms)
            return True
        except (RedisError, OSError) as e:
            log.warning("heartbeat of %s failed: %s", self.record.worker_id, describe_error(e, self._url))
            return False

    async def _loop(self) -> None:
        while True:
            await self.beat()
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._loop())

    async def stop(self) -> None:
        await stop_tasks(self._task)
        try:
            await self.redis.delete(self.key)
        except (RedisError, OSError):
            pass
        await self.redis.aclose()


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
        if isinstance(e, BlockStored):
            return {"seq": e.seq, "type": "stored", "hash": e.block_hash, "parent": e.parent_hash}
        if isinstance(e, BlockRemoved):
            return {"seq": e.seq, "type": "removed", "hash": e.block_hash}
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
    f = {k.decode() if isinstance(k, bytes) else k: v.decode() if isinstance(v, bytes) else v for k, v in fields.items()}
    seq = int(f["seq"])
    if f["type"] == "stored":
        return BlockStored(seq, int(f["hash"]), int(f.get("parent", 0)), (), -1)
    if f["type"] == "removed":
        return BlockRemoved(seq, int(f["hash"]), -1)
    return AllBlocksCleared(seq)


async def list_workers(redis: aioredis.Redis, cluster: str) -> list[WorkerRecord]:
    out = []
    async for key in redis.scan_iter(match=worker_key(cluster, "*"), count=500):
        raw = await redis.get(key)
        if raw:
            out.append(WorkerRecord(**json.loads(raw)))
    return sorted(out, key=lambda r: r.worker_id)


class EventFollower:
    """Router side: reads every worker's event stream into a PrefixIndex."""

    def __init__(self, redis: aioredis.Redis, cluster: str, index):
        self.redis, self.cluster, self.index = redis, cluster, index
        self._last_id: dict[str, bytes | str] = {}

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
        streams = {events_key(self.cluster, w): self._last_id.get(w, "0") for w in worker_ids}
        applied = 0
        for key, entries in await self.redis.xread(streams, count=count):
            wid = (key.decode() if isinstance(key, bytes) else key).rsplit(":", 1)[1]
            for entry_id, fields in entries:
                self.index.apply(wid, decode_event(fields))
                self._last_id[wid] = entry_id
                applied += 1
        return applied
