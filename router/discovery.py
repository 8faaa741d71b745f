"""Keeps a ClusterClient in step with the Redis registry and the workers' KV event streams."""
from __future__ import annotations

import logging
import time

import grpc
from redis.exceptions import RedisError

from pdserve.protos.security import proves, stats_request
from pdserve.registry.events import EventFollower
from pdserve.registry.membership import list_workers
from pdserve.registry.urls import connect, describe_error

from .cluster import ClusterClient, WorkerEndpoint

log = logging.getLogger("pdserve.router")


class RegistryDiscovery:
    def __init__(self, redis_url: str, cluster_name: str, client: ClusterClient, grace_s: float = 10.0):
        """grace_s: how long a worker missing from the registry is still routed to (Redis
        restarted and it has not re-registered yet); unhealthy workers are skipped anyway."""
        self.redis, self._url = connect(redis_url), redis_url
        self.cluster_name, self.client = cluster_name, client
        self.grace_s = grace_s
        self.follower = EventFollower(self.redis, cluster_name, client.index)
        self._incarnations: dict[str, str] = {}
        self._seen: dict[str, tuple[WorkerEndpoint, float]] = {}
        self.resyncs = 0
        self.malformed_records = 0  # registry entries skipped: not worker records

    async def sync(self) -> None:
        """One round: membership, new events, resyncs. With Redis unreachable the router
        keeps routing on what it last knew."""
        try:
            records = await list_workers(self.redis, self.cluster_name, on_malformed=self._malformed)
        except (RedisError, OSError) as e:
            log.warning("registry unreachable, keeping the last known workers: %s", describe_error(e, self._url))
            return
        now = time.monotonic()
        for r in records:
            if self._incarnations.get(r.worker_id, r.incarnation) != r.incarnation:
                self.client.index.remove_worker(r.worker_id)  # restarted: its old blocks are gone
                self.follower.rewind(r.worker_id)
            self._incarnations[r.worker_id] = r.incarnation
            self._seen[r.worker_id] = (WorkerEndpoint(worker_id=r.worker_id, role=r.role, address=r.address), now)
        self._seen = {w: v for w, v in self._seen.items() if now - v[1] < self.grace_s}
        self.client.set_workers([ep for ep, _ in self._seen.values()])
        try:
            await self.follower.poll([r.worker_id for r in records])
        except (RedisError, OSError) as e:
            log.warning("KV event streams unreachable: %s", describe_error(e, self._url))
        for wid in list(self.client.index.needs_resync):
            await self._resync(wid)

    def _malformed(self, key: str, why: str) -> None:
        self.malformed_records += 1
        log.warning("skipped registry entry %s: %s", key[:200], why)

    async def _resync(self, worker_id: str) -> None:
        w = self.client.workers.get(worker_id)
        if w is None:
            return
        try:
            req = stats_request(self.client.cluster_token, w.identity)
            snap = await self.client._stub(w).CachedBlocks(req, timeout=5.0)
            if not proves(self.client.cluster_token, req, snap):
                return  # not this record's worker (ClusterClient.refresh says so): its blocks are not taken
        except grpc.aio.AioRpcError as e:
            log.warning("resync of %s failed: %s", worker_id, e.details())
            return
        self.client.index.reset_worker(worker_id, list(snap.block_hashes), snap.seq)
        self.follower.rewind(worker_id)
        self.resyncs += 1

    async def close(self) -> None:
        await self.redis.aclose()
