"""The conventions of refusals and errors across the internal gRPC services: a worker that
refuses a request says who refused and why in trailing metadata, so the router can try
another worker of the pool (a full queue) or answer the client's 400 naming the field the
worker found wrong, as if it had found it itself."""
from __future__ import annotations

import grpc

from pdserve.common.errors import InvalidRequestError

REFUSED_BY = "pdserve-refused-by"
"""Trailing-metadata key naming the worker that refused a request because its queue is full."""
INVALID_PARAM, INVALID_CODE = "pdserve-param", "pdserve-code"
"""Trailing-metadata keys of an invalid request's field and error code."""


async def refuse_when_full(context, worker_id: str, what: str, limit: int = 0, state: str = "") -> None:
    """Abort the RPC with RESOURCE_EXHAUSTED, naming the refusing worker so the router can
    try another one of its pool (or answer 429 when the whole pool is full). `state`: why,
    if not the queue limit (e.g. "draining")."""
    why = state or "at its queue limit" + (f" ({limit} requests)" if limit else "")
    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{what} {worker_id} is {why}",
                        trailing_metadata=((REFUSED_BY, worker_id),))


async def refuse_invalid(context, e: InvalidRequestError) -> None:
    """Abort the RPC with INVALID_ARGUMENT, carrying the error's field and code, so the
    router's 400 names them as if it had found the error itself."""
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e),
                        trailing_metadata=((INVALID_PARAM, e.param or ""), (INVALID_CODE, e.code or "")))


def invalid_details(e: grpc.aio.AioRpcError) -> tuple[str | None, str | None]:
    """(param, code) sent by `refuse_invalid`; None where absent."""
    meta = dict(e.trailing_metadata() or ())
    return meta.get(INVALID_PARAM) or None, meta.get(INVALID_CODE) or None


def refused_by(e: grpc.aio.AioRpcError) -> str:
    """The worker named by `refuse_when_full`, or "" if the error does not name one."""
    for key, value in e.trailing_metadata() or ():
        if key == REFUSED_BY:
            return value
    return ""
