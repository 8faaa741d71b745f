"""Where a request's rate limits and usage meet HTTP: `RequestEnd` (ASGI, around the app) adds a
rate-limited key's `x-ratelimit-*` figures to its response and, once the response has been sent
whole, counts the request out of its limits and records what it used in the usage store;
`GET /admin/usage` reads that store (router/usage.py) for a window."""
from __future__ import annotations

import asyncio
import logging
import time

from fastapi import Depends, FastAPI, Request
from redis.exceptions import RedisError

from .errors import APIError
from .ratelimit import RateLimiter
from .usage import MemoryUsage, RedisUsage, UsageWindowError, report

log = logging.getLogger(__name__)


class RequestEnd:
    """Around the app: the response of a rate-limited request carries its key's `x-ratelimit-*`
    figures (`state.ticket`), and once it has been sent whole (a stream to its end, or cut
    off) the request is counted out with the tokens it used and its `state.meter` recorded."""

    def __init__(self, app, limiter: RateLimiter, usage: MemoryUsage | RedisUsage):
        self.app, self.limiter, self.usage = app, limiter, usage

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = scope.setdefault("state", {})

        async def with_headers(message):
            ticket = state.get("ticket")
            if message["type"] == "http.response.start" and ticket is not None and ticket.headers:
                message = message | {"headers": [*message.get("headers", []),
                                                  *((k.encode(), v.encode()) for k, v in ticket.headers.items())]}
            await send(message)
        try:
            await self.app(scope, receive, with_headers)
        finally:
            try:
                await self._count_out(state.get("meter"), state.get("ticket"))
            except asyncio.CancelledError:  # the server stops: its last requests' counts go unrecorded
                log.warning("a request was not counted out of its limits and usage: the server is stopping")

    async def _count_out(self, meter, ticket) -> None:
        if ticket is not None:
            await self.limiter.leave(ticket, meter.tokens if meter is not None else 0)
        if meter is not None and meter.rows:
            try:
                await self.usage.record(meter, time.time())
            except (RedisError, OSError) as e:  # /metrics still has it
                log.warning("usage of a request not recorded (%s: %s)", type(e).__name__, e)


def add_usage_route(app: FastAPI, usage: MemoryUsage | RedisUsage, admin) -> None:
    """GET /admin/usage?since=&until=&group_by=tenant (admin-authenticated): the usage totals of
    a window, per tenant, key, model or several (router/usage.py `report`); 400 for a bad window,
    503 when the store cannot be read."""
    @app.get("/admin/usage", dependencies=[Depends(admin)])
    async def read_usage(request: Request):
        q = request.query_params
        unknown = set(q) - {"since", "until", "group_by"}
        if unknown:
            raise APIError(400, f"unknown parameter {min(unknown)!r} (since, until, group_by)", param=min(unknown),
                           code="invalid_window")
        try:
            return await report(usage, q.get("since"), q.get("until"), q.get("group_by", "tenant"))
        except UsageWindowError as e:
            raise APIError(400, str(e), param="window", code="invalid_window") from None
        except (RedisError, OSError) as e:
            raise APIError(503, f"the usage store cannot be read now ({type(e).__name__}); retry later",
                           "server_error", code="usage_unavailable", headers={"Retry-After": "1"}) from None
