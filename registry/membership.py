"""Cluster membership: each worker keeps `pdserve:<cluster>:worker:<id>` (JSON, with a TTL)
alive by heartbeat; a worker that dies simply expires. Routers list the keys. Redis being
unreachable never stops a worker: its heartbeat retries."""
from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import asdict, dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from pdserve.common.aio import stop_tasks

from .urls import connect, describe_error

log = logging.getLogger("pdserve.registry")


def worker_key(cluster: str, worker_id: str) -> str:
    return f"pdserve:{cluster}:worker:{worker_id}"


@dataclass(frozen=True)
class WorkerRecord:
    worker_id: str
    role: str          # "prefill" | "decode" | "aggregated"
    address: str       # gRPC service
    kv_address: str = ""
    incarnation: str = ""  # differs on every start: a restarted worker's events start again at 1
    metrics_port: int = 0  # its own Prometheus /metrics (model-server series) on its address's host; 0: none


class WorkerRegistration:
    """Keeps one worker's registry key alive while it runs."""

    def __init__(self, redis_url: str, cluster: str, record: WorkerRecord, ttl_s: float = 5.0, interval_s: float = 1.0):
        self.redis, self._url = connect(redis_url), redis_url
        self.key, self.record = worker_key(cluster, record.worker_id), record
        self.ttl_ms, self.interval_s = int(ttl_s * 1000), interval_s
        self._task: asyncio.Task | None = None
        self.last_error = ""
        """Why the latest heartbeat failed ("": it succeeded), secrets removed."""

    async def beat(self) -> bool:
        try:
            await self.redis.set(self.key, json.dumps(asdict(self.record)), px=self.ttl_ms)
            self.last_error = ""
            return True
        except (RedisError, OSError) as e:
            self.last_error = describe_error(e, self._url)
            log.warning("heartbeat of %s failed: %s", self.record.worker_id, self.last_error)
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


ROLES = ("prefill", "decode", "aggregated")


def parse_record(raw: bytes | str) -> WorkerRecord:
    """A registry entry as a WorkerRecord; ValueError names what is wrong with it. Redis is
    input like any other: whoever can write there must not be able to break a router."""
    try:
        d = json.loads(raw)
    except (TypeError, ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"not JSON: {e}") from None
    if not isinstance(d, dict):
        raise ValueError("not a JSON object")
    fields = {"worker_id", "role", "address", "kv_address", "incarnation", "metrics_port"}
    if set(d) - fields or not {"worker_id", "role", "address"} <= set(d):
        raise ValueError(f"fields {sorted(d)}; expected {sorted(fields)}")
    port = d.get("metrics_port", 0)
    if type(port) is not int or not 0 <= port < 65536:
        raise ValueError(f"metrics_port must be a port number, got {port!r}")
    if not all(isinstance(v, str) and len(v) <= 1024 for k, v in d.items() if k != "metrics_port"):
        raise ValueError("every field but metrics_port must be a string of at most 1024 characters")
    if d["role"] not in ROLES or not d["worker_id"] or not d["address"]:
        raise ValueError(f"role {d['role']!r} (one of {', '.join(ROLES)}), worker_id and address must be set")
    return WorkerRecord(**d)


async def list_workers(redis: aioredis.Redis, cluster: str, on_malformed=None) -> list[WorkerRecord]:
    """The cluster's registered workers, by id. An entry that is not a worker record is
    skipped; `on_malformed(key, why)` hears of it."""
    out = []
    async for key in redis.scan_iter(match=worker_key(cluster, "*"), count=500):
        raw = await redis.get(key)
        if not raw:
            continue
        try:
            out.append(parse_record(raw))
        except ValueError as e:
            if on_malformed is not None:
                on_malformed(key.decode(errors="replace") if isinstance(key, bytes) else key, str(e))
    return sorted(out, key=lambda r: r.worker_id)
