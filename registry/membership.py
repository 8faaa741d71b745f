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

from pdserve.engine.aio import stop_tasks

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


async def list_workers(redis: aioredis.Redis, cluster: str) -> list[WorkerRecord]:
    out = []
    async for key in redis.scan_iter(match=worker_key(cluster, "*"), count=500):
        raw = await redis.get(key)
        if raw:
            out.append(WorkerRecord(**json.loads(raw)))
    return sorted(out, key=lambda r: r.worker_id)
