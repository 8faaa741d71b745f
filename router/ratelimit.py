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

Requests at once and queued prompts are not counters but leases: each request (each admitted
prompt) is a member of a set per scope that counts until it is released or its lease ends
(`lease_s`, an hour by default, renewed while its router counts requests in). A release lost
to a Redis outage is retried by this router once Redis answers again, and the requests of a
router that died stop counting when their leases end, so that one Redis hiccup can never hold
a key at its limit for good.
"""
from __future__ import annotations

import itertools
import math
import time
import uuid
from dataclasses import dataclass, field

from redis.exceptions import RedisError

from .errors import APIError
from .keys import APIKey, Limits

WINDOW_S = 60
LEASE_S = 3600  # a request not released nor renewed for this long stops counting
MAX_LOST = 10_000  # releases kept for retry; beyond them the leases alone free the slots


class MemoryCounts:
    """Counters with expiry, and sets of leases, in this process."""

    def __init__(self, clock=time.time):
        self.clock, self._v, self._sets = clock, {}, {}

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

    async def hold(self, name: str, member: str, until: float, now: float) -> list[str]:
        """Drop the members of set `name` whose lease ended by `now`, hold `member` until
        `until`, and return the members held."""
        held = self._sets[name] = {m: u for m, u in self._sets.get(name, {}).items() if u > now}
        held[member] = until
        return list(held)

    async def held(self, name: str, now: float) -> list[str]:
        return [m for m, u in self._sets.get(name, {}).items() if u > now]

    async def renew(self, name: str, members: list[str], until: float, now: float) -> None:
        """Hold those of `members` still held until `until` (a released one stays released)."""
        held = self._sets.get(name, {})
        for m in members:
            if held.get(m, 0.0) > now:
                held[m] = until

    async def release(self, name: str, *members: str) -> None:
        for m in members:
            self._sets.get(name, {}).pop(m, None)


class RedisCounts:
    """The same in Redis: INCRBY and EXPIRE in one round trip; a set of leases is a sorted set
    (member -> the time its lease ends), trimmed, added to and read in one transaction."""

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

    async def hold(self, name: str, member: str, until: float, now: float) -> list[str]:
        key = f"{self.ns}:{name}"
        async with self.redis.pipeline(transaction=True) as p:
            p.zremrangebyscore(key, "-inf", now)
            p.zadd(key, {member: until})
            p.expire(key, max(1, math.ceil(until - now)))  # the newest lease ends last
            p.zrange(key, 0, -1)
            *_, members = await p.execute()
        return [m.decode() if isinstance(m, bytes) else m for m in members]

    async def held(self, name: str, now: float) -> list[str]:
        members = await self.redis.zrangebyscore(f"{self.ns}:{name}", f"({now}", "+inf")
        return [m.decode() if isinstance(m, bytes) else m for m in members]

    async def renew(self, name: str, members: list[str], until: float, now: float) -> None:
        key = f"{self.ns}:{name}"
        async with self.redis.pipeline(transaction=True) as p:
            p.zadd(key, dict.fromkeys(members, until), xx=True)  # XX: a release meanwhile stands
            p.expire(key, max(1, math.ceil(until - now)))
            await p.execute()

    async def release(self, name: str, *members: str) -> None:
        if members:
            await self.redis.zrem(f"{self.ns}:{name}", *members)


@dataclass
class Ticket:
    """A request counted in: the count prefixes of its scopes (the key's, its tenant's), its key,
    the leases it holds ((set, member): its place in each scope's requests at once, its prompts
    queued), and the headers its response carries."""
    scopes: dict[str, Limits] = field(default_factory=dict)
    key: APIKey | None = None
    held: list[tuple[str, str]] = field(default_factory=list)
    headers: dict[str, str] = field(default_factory=dict)
    counted: bool = False
    id: str = field(default_factory=lambda: uuid.uuid4().hex)


def running(scope: str) -> str:
    """The set of a scope's requests in flight. (Not `{scope}:now`: that name was a plain
    counter before, a string in Redis that expires on its own within the hour.)"""
    return f"{scope}:running"


def queued(scope: str) -> str:
    """The set of a scope's queued prompts, each member `{ticket id}.{n}:{prompt tokens}`."""
    return f"{scope}:queued-prompts"


def _tokens(members: list[str]) -> int:
    return sum(int(m.rsplit(":", 1)[1]) for m in members)


def _unavailable(key: APIKey, e: Exception) -> APIError:
    return APIError(503, f"the rate limits of the key {key.name!r} cannot be counted now ({type(e).__name__}); "
                         "retry later", "server_error", code="rate_limit_unavailable", headers={"Retry-After": "1"})


def _over(limits: Limits, requests: int, tokens: int, concurrent: int) -> str:
    """The limit a request counted in passes ("": none)."""
    return ("requests" if limits.requests_per_minute and requests > limits.requests_per_minute else
            "tokens" if limits.tokens_per_minute and tokens >= limits.tokens_per_minute else
            "concurrent" if limits.max_concurrent and concurrent > limits.max_concurrent else "")


class RateLimiter:
    """`lease_s`: how long a request counts at most among its scopes' requests at once and
    queued prompts when its release is lost and its lease not renewed (its router died)."""

    def __init__(self, counts: MemoryCounts | RedisCounts, clock=time.time, lease_s: float = LEASE_S):
        self.counts, self.clock, self.lease_s = counts, clock, lease_s
        self._lost: list[tuple[str, str]] = []  # leases whose release Redis did not take
        self._retry_at = self._renew_at = 0.0
        self._seq = itertools.count()
        self._live: dict[str, Ticket] = {}  # id -> this router's requests counted in, until they leave

    def scopes(self, key_id: str, key: APIKey) -> dict[str, Limits]:
        """Count prefix -> limits: the key's own, and its tenant's (counted across its keys)."""
        out = {f"rl:{key_id}": key.limits} if key.limits else {}
        return out | ({f"rl:tenant:{key.tenant}": key.tenant_limits} if key.tenant_limits else {})

    async def enter(self, key_id: str, key: APIKey) -> Ticket:
        """Count a request of `key` in, in its scope and its tenant's, or raise APIError: 429
        past a limit of either (the counts undone), 503 when the counts cannot be reached and
        the key fails closed (what was counted undone, or released once Redis is back). Each
        header gives the tighter of the two scopes' figures."""
        if not key.limited:
            return Ticket()
        await self._retry_lost()
        now = self.clock()
        await self._renew(now)
        window, reset = int(now // WINDOW_S), WINDOW_S - now % WINDOW_S
        ticket, refusal = Ticket(self.scopes(key_id, key), key), None
        remaining: dict[str, tuple[int, int]] = {}  # what -> (remaining, limit), the tightest
        counted: list[str] = []  # the scopes whose request count took this one
        try:
            for scope, limits in ticket.scopes.items():
                requests = await self.counts.add(f"{scope}:req:{window}", 1, 2 * WINDOW_S)
                counted.append(scope)
                tokens = await self.counts.get(f"{scope}:tok:{window}")
                concurrent = 0
                if limits.max_concurrent:
                    ticket.held.append((running(scope), ticket.id))  # first: a failed hold may have been taken
                    concurrent = len(await self.counts.hold(running(scope), ticket.id, now + self.lease_s, now))
                ticket.counted = True
                for what, limit, used in (("requests", limits.requests_per_minute, requests),
                                          ("tokens", limits.tokens_per_minute, tokens)):
                    if limit and (what not in remaining or limit - used < remaining[what][0]):
                        remaining[what] = (limit - used, limit)
                over = _over(limits, requests, tokens, concurrent)
                if over and refusal is None:
                    refusal = (over, limits, scope)
        except (RedisError, OSError) as e:
            await self._undo(ticket, window, counted)
            if key.fail_closed:
                raise _unavailable(key, e) from None
            return Ticket()
        for what, (left, limit) in remaining.items():
            ticket.headers |= {f"x-ratelimit-limit-{what}": str(limit),
                               f"x-ratelimit-remaining-{what}": str(max(left, 0)),
                               f"x-ratelimit-reset-{what}": f"{math.ceil(reset)}s"}
        if refusal is not None:
            await self._undo(ticket, window, counted)
            self._refuse(key, *refusal, reset, ticket.headers)
        self._live[ticket.id] = ticket
        return ticket

    async def _undo(self, ticket: Ticket, window: int, counted: list[str]) -> None:
        """A refused request, or one Redis failed to count: not counted in any scope. Its
        leases are released now or retried later; a request count Redis does not take back
        stays in its minute's window."""
        ticket.counted = False
        held, ticket.held = ticket.held, []
        try:
            for scope in counted:
                await self.counts.add(f"{scope}:req:{window}", -1, 2 * WINDOW_S)
        except (RedisError, OSError):
            pass
        await self._release(held)

    async def _release(self, held: list[tuple[str, str]]) -> None:
        """Release leases, a round trip per set; those Redis does not take are kept to retry
        (`_retry_lost`), at most MAX_LOST of them: their leases free the rest."""
        sets: dict[str, list[str]] = {}
        for name, member in held:
            sets.setdefault(name, []).append(member)
        pending = list(sets.items())
        for i, (name, members) in enumerate(pending):
            try:
                await self.counts.release(name, *members)
            except (RedisError, OSError):
                self._lost = (self._lost + [(n, m) for n, ms in pending[i:] for m in ms])[-MAX_LOST:]
                return

    async def _retry_lost(self) -> None:
        """The lost releases again, at most once a second while Redis does not take them (a
        request under a limited key would otherwise wait out a timeout twice)."""
        if not self._lost or self.clock() < self._retry_at:
            return
        lost, self._lost = self._lost, []
        await self._release(lost)
        if self._lost:
            self._retry_at = self.clock() + 1

    async def _renew(self, now: float) -> None:
        """The leases of this router's requests in flight, renewed every quarter lease while it
        counts requests in: only a request whose router died, or that counts none in for most
        of a lease, outlives its lease (an hour by default)."""
        if now < self._renew_at or not self._live:
            return
        self._renew_at = now + self.lease_s / 4
        sets: dict[str, list[str]] = {}
        for ticket in list(self._live.values()):
            for name, member in ticket.held:
                sets.setdefault(name, []).append(member)
        try:
            for name, members in sets.items():
                await self.counts.renew(name, members, now + self.lease_s, now)
        except (RedisError, OSError):
            self._renew_at = now + 1  # again on a request a second later

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
        now, added = self.clock(), []
        try:
            for scope, limits in ticket.scopes.items():
                if not limits.max_queued_tokens:
                    continue
                lease = (queued(scope), f"{ticket.id}.{next(self._seq)}:{prompt_tokens}")
                ticket.held.append(lease)  # released when the request ends, whatever happens here
                added.append(lease)
                total = _tokens(await self.counts.hold(*lease, now + self.lease_s, now))
                if total > limits.max_queued_tokens and total > prompt_tokens:
                    ticket.held = [h for h in ticket.held if h not in added]
                    await self._release(added)
                    who = (f"the tenant {ticket.key.tenant!r}" if scope.startswith("rl:tenant:")
                           else f"the key {ticket.key.name!r}")
                    raise APIError(429, f"{who} has {total - prompt_tokens} prompt tokens queued; this prompt's "
                                        f"{prompt_tokens} would pass its limit of {limits.max_queued_tokens}; "
                                        "retry when a request ends", "rate_limit_error",
                                   code="rate_limit_queued_tokens", headers=ticket.headers | {"Retry-After": "1"})
        except (RedisError, OSError) as e:
            if ticket.key.fail_closed:
                raise _unavailable(ticket.key, e) from None

    async def leave(self, ticket: Ticket, tokens: int) -> None:
        """Count a request out, with the tokens it used (in the window it ends in): its leases
        released, or retried on a later request when Redis cannot be reached (and ended by
        their lease at the latest)."""
        if not ticket.counted:
            return
        ticket.counted = False
        self._live.pop(ticket.id, None)
        held, ticket.held = ticket.held, []
        await self._release(held)
        window = int(self.clock() // WINDOW_S)
        try:
            for scope in ticket.scopes if tokens else ():
                await self.counts.add(f"{scope}:tok:{window}", tokens, 2 * WINDOW_S)
        except (RedisError, OSError):
            pass  # its tokens go uncounted this minute

    async def in_flight(self, scope: str) -> tuple[int, int]:
        """A scope's (`rl:{key id}`, `rl:tenant:{name}`) requests in flight and prompt tokens
        queued: the leases not released nor ended (counted only where the scope has a limit)."""
        now = self.clock()
        return (len(await self.counts.held(running(scope), now)),
                _tokens(await self.counts.held(queued(scope), now)))
