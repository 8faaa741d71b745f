"""Stored responses (`store: true`), for `GET`/`DELETE /v1/responses/{id}` and for a follow-up
that names one as its `previous_response_id`.

Each is kept under its tenant (the API key's digest, or the tenant header's), so one tenant
cannot read, continue or delete another's: to it they do not exist. Bounded by age (a TTL)
and by count per tenant (the oldest go first). In the cluster's Redis (`pdserve:<cluster>:
response:<tenant digest>:<id>`, the ids by age in a sorted set beside them) where the router
has a registry, so that every router of the cluster sees them; else in the router's memory.
"""
from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass

from redis.exceptions import RedisError

from .errors import APIError

MAX_AGE_S = 7 * 24 * 3600
"""A stored response is forgotten this long after it was made."""
MAX_PER_TENANT = 10_000
"""Stored responses per tenant at most; past it the oldest are forgotten."""
MAX_ID = 256


@dataclass
class StoredResponse:
    response: dict
    """The response object, as `GET` returns it."""
    conversation: list[dict]
    """The conversation's chat messages up to and including this response's answer (without
    instructions, which do not carry over)."""
    session: str
    """The conversation's first response id: its turns stay on one decode worker by it."""


def tenant_digest(tenant: str) -> str:
    """A fixed-length key part for a tenant id (any text up to 256 characters)."""
    return hashlib.sha256(tenant.encode()).hexdigest()[:32]


class MemoryResponseStore:
    """The store of a router without a registry: per tenant, insertion-ordered."""

    def __init__(self, max_age_s: float = MAX_AGE_S, max_per_tenant: int = MAX_PER_TENANT):
        self.max_age_s, self.max_per_tenant = max_age_s, max_per_tenant
        self.tenants: dict[str, OrderedDict[str, tuple[float, StoredResponse]]] = {}

    async def put(self, tenant: str, rid: str, stored: StoredResponse) -> None:
        kept = self.tenants.setdefault(tenant, OrderedDict())
        kept[rid] = (time.time(), stored)
        self._prune(tenant)

    def _prune(self, tenant: str) -> None:
        kept = self.tenants.get(tenant, OrderedDict())
        oldest = time.time() - self.max_age_s
        while kept and (len(kept) > self.max_per_tenant or next(iter(kept.values()))[0] < oldest):
            kept.popitem(last=False)
        if not kept:
            self.tenants.pop(tenant, None)

    async def get(self, tenant: str, rid: str) -> StoredResponse | None:
        self._prune(tenant)
        entry = self.tenants.get(tenant, {}).get(rid)
        return entry[1] if entry else None

    async def delete(self, tenant: str, rid: str) -> bool:
        return self.tenants.get(tenant, {}).pop(rid, None) is not None


class RedisResponseStore:
    """The store in the cluster's Redis: each response a JSON value with a TTL, and per tenant
    a sorted set of its ids by time, which bounds their count."""

    def __init__(self, redis, cluster: str, max_age_s: float = MAX_AGE_S, max_per_tenant: int = MAX_PER_TENANT):
        """redis: a `redis.asyncio` client (the router's registry connection, closed by its owner)."""
        self.redis, self.cluster = redis, cluster
        self.max_age_s, self.max_per_tenant = max_age_s, max_per_tenant

    def _key(self, tenant: str, rid: str) -> str:
        return f"pdserve:{self.cluster}:response:{tenant_digest(tenant)}:{rid}"

    def _index(self, tenant: str) -> str:
        return f"pdserve:{self.cluster}:responses:{tenant_digest(tenant)}"

    async def put(self, tenant: str, rid: str, stored: StoredResponse) -> None:
        now, ttl, index = time.time(), int(self.max_age_s) or 1, self._index(tenant)
        async with self.redis.pipeline(transaction=True) as p:
            p.set(self._key(tenant, rid), json.dumps(asdict(stored), ensure_ascii=False), ex=ttl)
            p.zadd(index, {rid: now})
            p.zremrangebyscore(index, "-inf", now - self.max_age_s)  # their values have expired already
            p.expire(index, ttl)
            p.zcard(index)
            count = (await p.execute())[-1]
        if count > self.max_per_tenant:
            oldest = await self.redis.zpopmin(index, count - self.max_per_tenant)
            if oldest:
                await self.redis.delete(*(self._key(tenant, r.decode() if isinstance(r, bytes) else r)
                                          for r, _ in oldest))

    async def get(self, tenant: str, rid: str) -> StoredResponse | None:
        raw = await self.redis.get(self._key(tenant, rid))
        return StoredResponse(**json.loads(raw)) if raw is not None else None

    async def delete(self, tenant: str, rid: str) -> bool:
        async with self.redis.pipeline(transaction=True) as p:
            p.delete(self._key(tenant, rid))
            p.zrem(self._index(tenant), rid)
            deleted, _ = await p.execute()
        return bool(deleted)


class ResponseStore:
    """A store (Redis or memory) whose failures are the API's: an id that cannot be one is
    simply not found, and Redis out of reach is a 503."""

    def __init__(self, backend):
        self.backend = backend

    @classmethod
    def of_router(cls, router) -> "ResponseStore":
        """The cluster's Redis when the router has a registry, else the router's memory."""
        discovery = router.discovery
        if discovery is None:
            return cls(MemoryResponseStore())
        return cls(RedisResponseStore(discovery.redis, discovery.cluster_name))

    async def _call(self, method: str, tenant: str, rid: str, *args):
        try:
            return await getattr(self.backend, method)(tenant, rid, *args)
        except (RedisError, OSError) as e:
            raise APIError(503, f"the response store is unreachable ({type(e).__name__}); retry shortly",
                           "server_error", code="store_unavailable") from e

    async def put(self, tenant: str, rid: str, stored: StoredResponse) -> None:
        await self._call("put", tenant, rid, stored)

    async def get(self, tenant: str, rid: str) -> StoredResponse | None:
        if not rid or len(rid) > MAX_ID:
            return None
        return await self._call("get", tenant, rid)

    async def delete(self, tenant: str, rid: str) -> bool:
        if not rid or len(rid) > MAX_ID:
            return False
        return await self._call("delete", tenant, rid)
