"""Rate limits per operator key and per tenant (router/keys.py): requests and tokens per minute,
requests at once, prompt tokens queued. Counted in the cluster's Redis when the router has one,
so that every router of the cluster holds one limit; else in this process.

`enter` counts a request in, in its key's scope and its tenant's (or refuses it: 429 with
OpenAI's `x-ratelimit-*` headers and Retry-After) and gives the headers every response under
the key carries; `admit` counts its tokenized prompt as queued; `leave` counts it out with the
prompt and completion tokens it used. Fixed one-minute windows; tokens count when the
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
from .keys import APIKey, Limits

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
    """A request counted in: the count prefixes of its scopes (the key's, its tenant's), its key,
    the queued prompt tokens it holds per scope, and the headers its response carries."""
    scopes: dict[str, Limits] = field(default_factory=dict)
    key: APIKey | None = None
    queued: dict[str, int] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    counted: bool = False


def _unavailable(key: APIKey, e: Exception) -> APIError:
    return APIError(503, f"the rate limits of the key {key.name!r} cannot be counted now ({type(e).__name__}); "
                         "retry later", "server_error", code="rate_limit_unavailable", headers={"Retry-After": "1"})


def _over(limits: Limits, requests: int, tokens: int, concurrent: int) -> str:
    """The limit a request counted in passes ("": none)."""
    return ("requests" if limits.requests_per_minute and requests > limits.requests_per_minute else
            "tokens" if limits.tokens_per_minute and tokens >= limits.tokens_per_minute else
            "concurrent" if limits.max_concurrent and concurrent > limits.max_concurrent else "")


class RateLimiter:
    def __init__(self, counts: MemoryCounts | RedisCounts, clock=time.time):
        self.counts, self.clock = counts, clock

    def scopes(self, key_id: str, key: APIKey) -> dict[str, Limits]:
        """Count prefix -> limits: the key's own, and its tenant's (counted across its keys)."""
        out = {f"rl:{key_id}": key.limits} if key.limits else {}
        return out | ({f"rl:tenant:{key.tenant}": key.tenant_limits} if key.tenant_limits else {})

    async def enter(self, key_id: str, key: APIKey) -> Ticket:
        """Count a request of `key` in, in its scope and its tenant's, or raise APIError: 429
        past a limit of either (the counts undone), 503 when the counts cannot be reached and
        the key fails closed. Each header gives the tighter of the two scopes' figures."""
        if not key.limited:
            return Ticket()
        now = self.clock()
        window, reset = int(now // WINDOW_S), WINDOW_S - now % WINDOW_S
        ticket, refusal = Ticket(self.scopes(key_id, key), key), None
        remaining: dict[str, tuple[int, int]] = {}  # what -> (remaining, limit), the tightest
        try:
            for scope, limits in ticket.scopes.items():
                requests = await self.counts.add(f"{scope}:req:{window}", 1, 2 * WINDOW_S)
                tokens = await self.counts.get(f"{scope}:tok:{window}")
                concurrent = await self.counts.add(f"{scope}:now", 1, 3600)
                ticket.counted = True
                for what, limit, used in (("requests", limits.requests_per_minute, requests),
                                          ("tokens", limits.tokens_per_minute, tokens)):
                    if limit and (what not in remaining or limit - used < remaining[what][0]):
                        remaining[what] = (limit - used, limit)
                over = _over(limits, requests, tokens, concurrent)
                if over and refusal is None:
                    refusal = (over, limits, scope)
        except (RedisError, OSError) as e:  # what was counted expires within the hour
            if key.fail_closed:
                raise _unavailable(key, e) from None
            return Ticket()
        for what, (left, limit) in remaining.items():
            ticket.headers |= {f"x-ratelimit-limit-{what}": str(limit),
                               f"x-ratelimit-remaining-{what}": str(max(left, 0)),
                               f"x-ratelimit-reset-{what}": f"{math.ceil(reset)}s"}
        if refusal is not None:
            await self._undo(ticket, window)
            self._refuse(key, *refusal, reset, ticket.headers)
        return ticket

    async def _undo(self, ticket: Ticket, window: int) -> None:
        """A refused request: not counted in any scope."""
        ticket.counted = False
        for scope in ticket.scopes:
            await self.counts.add(f"{scope}:req:{window}", -1, 2 * WINDOW_S)
            await self.counts.add(f"{scope}:now", -1, 3600)

    @staticmethod
    def _refuse(key: APIKey, over: str, limits: Limits, scope: str, reset: float, headers: dict) -> None:
        limit = {"requests": f"{limits.requests_per_minute} requests a minute",
                 "tokens": f"{limits.tokens_per_minute} tokens a minute",
                 "concurrent": f"{limits.max_concurrent} requests at once"}[over]
        who = f"the tenant {key.tenant!r}" if scope.startswith("rl:tenant:") else f"the key {key.name!r}"
        retry = "1" if over == "concurrent" else str(math.ceil(reset))
        raise APIError(429, f"{who} is past its limit of {limit}; retry after {retry} s",
                       "rate_limit_error", code=f"rate_limit_{over}", headers=headers | {"Retry-After": retry})

    async def admit(self, ticket: Ticket, prompt_tokens: int) -> None:
        """A prompt of the ticket's request, tokenized: its tokens count as queued (until the
        request ends) in each scope with a max_queued_tokens, or APIError 429
        rate_limit_queued_tokens when they would pass it while other tokens are queued there
        (a lone prompt longer than the limit is let through: it could never pass), 503 as `enter`."""
        if not ticket.counted:
            return
        added: dict[str, int] = {}
        try:
            for scope, limits in ticket.scopes.items():
                if not limits.max_queued_tokens:
                    continue
                queued = await self.counts.add(f"{scope}:queued", prompt_tokens, 3600)
                added[scope] = prompt_tokens
                if queued > limits.max_queued_tokens and queued > prompt_tokens:
                    for s, n in added.items():
                        await self.counts.add(f"{s}:queued", -n, 3600)
                    who = (f"the tenant {ticket.key.tenant!r}" if scope.startswith("rl:tenant:")
                           else f"the key {ticket.key.name!r}")
                    raise APIError(429, f"{who} has {queued - prompt_tokens} prompt tokens queued; this prompt's "
                                        f"{prompt_tokens} would pass its limit of {limits.max_queued_tokens}; "
                                        "retry when a request ends", "rate_limit_error",
                                   code="rate_limit_queued_tokens", headers=ticket.headers | {"Retry-After": "1"})
        except (RedisError, OSError) as e:
            if ticket.key.fail_closed:
                raise _unavailable(ticket.key, e) from None
        for s, n in added.items():
            ticket.queued[s] = ticket.queued.get(s, 0) + n

    async def leave(self, ticket: Ticket, tokens: int) -> None:
        """Count a request out, with the tokens it used (in the window it ends in) and the
        prompt tokens it held queued."""
        if not ticket.counted:
            return
        ticket.counted = False
        window = int(self.clock() // WINDOW_S)
        try:
            for scope in ticket.scopes:
                await self.counts.add(f"{scope}:now", -1, 3600)
                if ticket.queued.get(scope):
                    await self.counts.add(f"{scope}:queued", -ticket.queued[scope], 3600)
                if tokens:
                    await self.counts.add(f"{scope}:tok:{window}", tokens, 2 * WINDOW_S)
        except (RedisError, OSError):
            pass  # its concurrency and queued counts expire within the hour
