"""Usage for charge-back, kept where every router of the cluster writes it: prompt, cached and
completion tokens and requests, per tenant, operator key and model, in one-minute buckets.

A request's generations add what they used to its `Meter` as they end; once its response has
been sent, the router records the meter in a usage store: the cluster's Redis (`RedisUsage`:
one hash a minute, a field per tenant, key, model and kind, HINCRBY pipelined, kept
`RETENTION_S`), or this process's memory without Redis (`MemoryUsage`, the same interface).
Nothing is lost when a router restarts, and several routers add up. `GET /admin/usage` reads
the totals of a window (`window`, `group`). "cached" tokens are the prompt tokens the decode
worker found in its prefix cache (what responses report as `prompt_tokens_details.cached_tokens`).
"""
from __future__ import annotations

import json
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

BUCKET_S = 60
RETENTION_S = 8 * 86400  # a week and a day: a weekly charge-back run may come late
KINDS = ("prompt_tokens", "cached_tokens", "completion_tokens", "requests")
GROUPS = ("tenant", "key", "model")
Row = tuple[str, str, str]  # (tenant, key, model)


class UsageWindowError(ValueError):
    """A usage query's window or grouping cannot be read."""


@dataclass
class Meter:
    """What one HTTP request used, added by its generations as they end (router/generation.py)."""
    tokens: int = 0
    """Prompt and completion tokens (the key's tokens-per-minute count)."""
    rows: dict[Row, list[int]] = field(default_factory=dict)
    """(tenant, key, model) -> counts in KINDS order."""
    on_admit: Callable[[int], Awaitable[None]] | None = None
    """Called with each tokenized prompt's length before it is queued (the key's queued-tokens
    limit, router/ratelimit.py); None: not limited."""

    async def admit(self, prompt_tokens: int) -> None:
        """A prompt is about to queue: APIError (429) when its key may not queue more."""
        if self.on_admit is not None:
            await self.on_admit(prompt_tokens)

    def add(self, tenant: str, key: str, model: str, prompt: int, cached: int, completion: int,
            requests: int) -> None:
        self.tokens += prompt + completion
        counts = self.rows.setdefault((tenant or "default", key or "-", model), [0, 0, 0, 0])
        for i, n in enumerate((prompt, cached, completion, requests)):
            counts[i] += n


def _field(row: Row, kind: str) -> str:
    return json.dumps([*row, kind], separators=(",", ":"))


def _merge(into: dict[Row, list[int]], fields: dict) -> None:
    """Hash fields (as `_field` writes them) -> counts added into `into`."""
    for f, n in fields.items():
        tenant, key, model, kind = json.loads(f)
        into.setdefault((tenant, key, model), [0, 0, 0, 0])[KINDS.index(kind)] += int(n)


class MemoryUsage:
    """Usage buckets in this process (a router without Redis; lost when it stops)."""

    def __init__(self, retention_s: int = RETENTION_S):
        self.retention_s = retention_s
        self._buckets: dict[int, dict[str, int]] = {}

    async def record(self, meter: Meter, now: float) -> None:
        bucket = self._buckets.setdefault(int(now // BUCKET_S), {})
        for row, counts in meter.rows.items():
            for kind, n in zip(KINDS, counts):
                if n:
                    bucket[_field(row, kind)] = bucket.get(_field(row, kind), 0) + n
        oldest = int((now - self.retention_s) // BUCKET_S)
        for b in [b for b in self._buckets if b < oldest]:
            del self._buckets[b]

    async def read(self, first: int, last: int) -> dict[Row, list[int]]:
        """The summed counts of the buckets `first`..`last` (minutes since the epoch)."""
        out: dict[Row, list[int]] = {}
        for b in range(first, last + 1):
            _merge(out, self._buckets.get(b, {}))
        return out


class RedisUsage:
    """The same buckets in Redis: `{namespace}:usage:{minute}` hashes, expiring after `retention_s`."""

    CHUNK = 512  # buckets read per round trip

    def __init__(self, redis, namespace: str, retention_s: int = RETENTION_S):
        self.redis, self.ns, self.retention_s = redis, namespace, retention_s

    async def record(self, meter: Meter, now: float) -> None:
        name = f"{self.ns}:usage:{int(now // BUCKET_S)}"
        async with self.redis.pipeline(transaction=False) as p:
            for row, counts in meter.rows.items():
                for kind, n in zip(KINDS, counts):
                    if n:
                        p.hincrby(name, _field(row, kind), n)
            p.expire(name, self.retention_s + BUCKET_S)
            await p.execute()

    async def read(self, first: int, last: int) -> dict[Row, list[int]]:
        out: dict[Row, list[int]] = {}
        for start in range(first, last + 1, self.CHUNK):
            async with self.redis.pipeline(transaction=False) as p:
                for b in range(start, min(start + self.CHUNK, last + 1)):
                    p.hgetall(f"{self.ns}:usage:{b}")
                for fields in await p.execute():
                    _merge(out, {(k.decode() if isinstance(k, bytes) else k): v for k, v in fields.items()})
        return out


def parse_time(value: str, param: str) -> float:
    """Unix seconds ("1764871200") or ISO 8601 ("2026-12-04T18:00:00Z"; no zone: UTC)."""
    try:
        t = float(value)
    except ValueError:
        try:
            d = datetime.fromisoformat(value.strip())  # Python >= 3.11 reads a "Z"
        except ValueError:
            raise UsageWindowError(f"{param} must be unix seconds or an ISO 8601 time, got {value[:40]!r}") from None
        t = (d if d.tzinfo else d.replace(tzinfo=UTC)).timestamp()
    if not math.isfinite(t) or t < 0:
        raise UsageWindowError(f"{param} must be a time after 1970, got {value[:40]!r}")
    return t


def window(since: str | None, until: str | None, now: float, retention_s: int = RETENTION_S) -> tuple[int, int]:
    """The first and last minute buckets of [since, until): the whole minutes that cover it (at
    least the one `since` falls in). Defaults: until now, since a day before until."""
    end = parse_time(until, "until") if until else now
    start = parse_time(since, "since") if since else end - 86400
    if start > end:
        raise UsageWindowError(f"since ({start:.0f}) is after until ({end:.0f})")
    if end - start > retention_s:
        raise UsageWindowError(f"the window is longer than the {retention_s // 86400} days usage is kept")
    first = int(start // BUCKET_S)
    return first, max(first, math.ceil(end / BUCKET_S) - 1)


def group_names(by: str) -> list[str]:
    """"tenant,model" -> ["tenant", "model"]; UsageWindowError for an unknown or repeated name."""
    names = [g.strip() for g in by.split(",")]
    if not names or any(g not in GROUPS for g in names) or len(set(names)) != len(names):
        raise UsageWindowError(f"group_by must be one or more of {', '.join(GROUPS)} (comma-separated), "
                               f"got {by[:40]!r}")
    return names


def group(rows: dict[Row, list[int]], by: str) -> list[dict]:
    """The rows' totals grouped by `by` ("tenant", "key", "model" or several, comma-separated:
    "tenant,model"), sorted by the grouping; each with every kind and total_tokens."""
    names = group_names(by)
    sums: dict[tuple, list[int]] = {}
    for row, counts in rows.items():
        g = tuple(row[GROUPS.index(n)] for n in names)
        s = sums.setdefault(g, [0, 0, 0, 0])
        for i, n in enumerate(counts):
            s[i] += n
    return [dict(zip(names, g)) | totals(s) for g, s in sorted(sums.items())]


def totals(counts: list[int]) -> dict[str, int]:
    return dict(zip(KINDS, counts)) | {"total_tokens": counts[0] + counts[2]}


async def report(store: MemoryUsage | RedisUsage, since: str | None, until: str | None, by: str,
                 now: float | None = None) -> dict:
    """The body of GET /admin/usage: the window read (bucket bounds, in unix seconds), the
    groups' totals and the grand total; UsageWindowError for a bad window or grouping."""
    now = time.time() if now is None else now
    names = group_names(by)
    first, last = window(since, until, now, store.retention_s)
    rows = await store.read(first, last)
    data = group(rows, by)
    grand = [sum(c[i] for c in rows.values()) for i in range(len(KINDS))]
    return {"object": "usage", "since": first * BUCKET_S, "until": (last + 1) * BUCKET_S,
            "group_by": names, "data": data, "total": totals(grand)}
