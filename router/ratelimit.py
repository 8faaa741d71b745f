"""Rate limits per operator key (router/keys.py): requests and tokens per minute, requests at
once. Counted in the cluster's Redis when the router has one, so that every router of the
cluster holds one limit; else in this process.

`enter` counts a request in (or refuses it: 429 with OpenAI's `x-ratelimit-*` headers and
Retry-After) and gives the headers every response under the key carries; `leave` counts it out
with the prompt and completion tokens it used. Fixed one-minute windows; tokens count when the
request ends (a long stream's tokens land in the window it ends in). A Redis that cannot be
reached lets requests through uncounted, or refuses them (503) for a key that says
`on_redis_error = "closed"`.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from redis.exceptions import RedisError

from .errors import APIError
from .keys import APIKey

WINDOW_S = 60


class MemoryCounts:
    """Counters with expiry, in this process."""

    def __init__(self, clock=time.time):
        self.clock, self._v = clock, {}

    async def add(self, name: str, by: int, ttl_s: int) -> int:
        now = self.clock()
        value, until = self._v.get(name, (0, 0.0))
        if until <= now:
            value = 0
        self._v[name] = (value + by, now + ttl_s)
        return value + by

    async def get(self, name: str) -> int:
        value, until = self._v.get(name, (0, 0.0))
        return value if until > self.clock() else 0


class RedisCounts:
    """The same counters in Redis (INCRBY and EXPIRE in one round trip)."""

    def __init__(self, redis, namespace: str):
        self.redis, self.ns = redis, namespace

    async def add(self, name: str, by: int, ttl_s: int) -> int:
        async with self.redis.pipeline(transaction=True) as p:
            p.incrby(f"{self.ns}:{name}", by)
            p.expire(f"{self.ns}:{name}", ttl_s)
            value, _ = await p.execute()
        return int(value)

    async def get(self, name: str) -> int:
        return int(await self.redis.get(f"{self.ns}:{name}") or 0)


@dataclass
class Ticket:
    """A request counted in: the key's id, its window, and the headers its response carries."""
    key_id: str = ""
    window: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    counted: bool = False


class RateLimiter:
    def __init__(self, counts: MemoryCounts | RedisCounts, clock=time.time):
        self.counts, self.clock = counts, clock

    async def enter(self, key_id: str, key: APIKey) -> Ticket:
        """Count a request of `key` in, or raise APIError: 429 past a limit (the count undone),
        503 when the counts cannot be reached and the key fails closed."""
        if not key.limited:
            return Ticket()
        now = self.clock()
        window, reset = int(now // WINDOW_S), WINDOW_S - now % WINDOW_S
        try:
            requests = await self.counts.add(f"rl:{key_id}:req:{window}", 1, 2 * WINDOW_S)
            tokens = await self.counts.get(f"rl:{key_id}:tok:{window}")
            concurrent = await self.counts.add(f"rl:{key_id}:now", 1, 3600)
        except (RedisError, OSError) as e:
            if key.fail_closed:
                raise APIError(503, f"the rate limits of the key {key.name!r} cannot be counted now ({type(e).__name__});"
                                    " retry later", "server_error", code="rate_limit_unavailable",
                               headers={"Retry-After": "1"}) from None
            return Ticket()
        headers = {}
        for what, limit, used in (("requests", key.requests_per_minute, requests),
                                  ("tokens", key.tokens_per_minute, tokens)):
            if limit:
                headers |= {f"x-ratelimit-limit-{what}": str(limit),
                            f"x-ratelimit-remaining-{what}": str(max(limit - used, 0)),
                            f"x-ratelimit-reset-{what}": f"{math.ceil(reset)}s"}
        over = ("requests" if key.requests_per_minute and requests > key.requests_per_minute else
                "tokens" if key.tokens_per_minute and tokens >= key.tokens_per_minute else
                "concurrent" if key.max_concurrent and concurrent > key.max_concurrent else "")
        if over:
            await self.counts.add(f"rl:{key_id}:req:{window}", -1, 2 * WINDOW_S)
            await self.counts.add(f"rl:{key_id}:now", -1, 3600)
            limit = {"requests": f"{key.requests_per_minute} requests a minute",
                     "tokens": f"{key.tokens_per_minute} tokens a minute",
                     "concurrent": f"{key.max_concurrent} requests at once"}[over]
            retry = "1" if over == "concurrent" else str(math.ceil(reset))
            raise APIError(429, f"the key {key.name!r} is past its limit of {limit}; retry after {retry} s",
                           "rate_limit_error", code=f"rate_limit_{over}", headers=headers | {"Retry-After": retry})
        return Ticket(key_id, window, headers, counted=True)

    async def leave(self, ticket: Ticket, tokens: int) -> None:
        """Count a request out, with the tokens it used (in the window it ends in)."""
        if not ticket.counted:
            return
        ticket.counted = False
        try:
            await self.counts.add(f"rl:{ticket.key_id}:now", -1, 3600)
            if tokens:
                await self.counts.add(f"rl:{ticket.key_id}:tok:{int(self.clock() // WINDOW_S)}", tokens,
                                      2 * WINDOW_S)
        except (RedisError, OSError):
            pass  # its concurrency count expires with the key within the hour
