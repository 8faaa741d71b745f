"""The API's errors: `APIError` is what every handler raises, answered as OpenAI's
`{"error": {"message", "type", "param", "code"}}`; request-validation and Starlette errors are
turned into the same shape, and `ErrorBoundary` turns every other exception into it too, on
every route, so that no request is answered with a plain-text 500 or a dropped connection."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

from pdserve.common.checks import MAX_JSON_DEPTH
from pdserve.common.errors import InvalidRequestError

log = logging.getLogger("pdserve.router")


class APIError(Exception):
    """An error the API returns as `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def validation_error(errors: list[dict]) -> APIError:
    """Turn pydantic's errors into one OpenAI-style error naming the first bad field."""
    e = errors[0]
    # a union's member appears in the location as its type ("prompt.list[int]"): not a field
    loc = [str(x) for x in e.get("loc", ()) if x != "body" and str(x) not in _TYPE_TAGS and "[" not in str(x)]
    param = ".".join(loc) or None
    if e.get("type") == "extra_forbidden":
        return APIError(400, f"unsupported parameter: {param}", param=param, code="unsupported_parameter")
    if e.get("type") == "json_invalid":
        return APIError(400, f"request body is not valid JSON: {e.get('msg')}", code="invalid_json")
    msg = e["ctx"]["error"] if e.get("type") == "value_error" and "error" in e.get("ctx", {}) else e.get("msg")
    return APIError(400, f"{param}: {msg}", param=param)


def http_error(status: int, detail: Any) -> APIError:
    """Starlette's own HTTP errors (a body that is not UTF-8 or not parseable, an unknown
    path, a wrong method) in the OpenAI shape, so that every 4xx has the same body."""
    return APIError(status, str(detail), "invalid_request_error" if status < 500 else "server_error")


def api_error_of(e: BaseException) -> APIError:
    """Any exception as the API's error: a 4xx where only the request can have caused it
    (its checks, its nesting, its text, its size), else a 500 that names nothing internal
    (the traceback goes to the log)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, InvalidRequestError):  # a check shared with the engine (pdserve.common)
        return APIError(400, str(e), param=e.param, code=e.code)
    if isinstance(e, RecursionError):  # what is bounded still recursed: only the request's shape can
        return APIError(400, f"the request is nested too deeply to process (JSON: at most {MAX_JSON_DEPTH} "
                             "levels)", code="nested_too_deeply")
    if isinstance(e, UnicodeError):
        return APIError(400, f"the request holds text that is not valid Unicode ({e.reason})", code="invalid_text")
    if isinstance(e, MemoryError):  # one request's allocation failed; the server goes on
        return APIError(413, "the request needs more memory than this server can give it: make it smaller",
                        code="request_too_large")
    log.error("unexpected error answering a request", exc_info=e)
    return APIError(500, f"internal error ({type(e).__name__}); the server logged it", "server_error",
                    code="internal_error")


def sse_error(e: BaseException) -> bytes:
    """The end of an event stream that failed after its first byte: the error, then [DONE]."""
    body = json.dumps(api_error_of(e).body(), ensure_ascii=False)
    return f"data: {body}\n\ndata: [DONE]\n\n".encode()


class ErrorBoundary:
    """ASGI middleware around the whole app: an exception that no handler answered becomes the
    API's error (`api_error_of`). Before the response starts, that is its status and body;
    after, an event stream gets the error event and `[DONE]`, any other body is ended."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = {"started": False, "sse": False, "ended": False}

        async def watched(message) -> None:
            if message["type"] == "http.response.start":
                state["started"] = True
                ctype = dict(message.get("headers", ())).get(b"content-type", b"")
                state["sse"] = ctype.startswith(b"text/event-stream")
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                state["ended"] = True
            await send(message)
        try:
            await self.app(scope, receive, watched)
        except Exception as e:  # noqa: BLE001 - the boundary: everything is answered
            if state["ended"]:
                log.error("error after a response was sent", exc_info=e)
                return
            await _answer(e, state, send)
        except asyncio.CancelledError:
            # the server cancels what is still in flight once its shutdown grace has run out: the
            # request's own cleanup has aborted its generations; its client hears why, not a
            # traceback in the server's log
            log.info("a request in flight was cancelled: the server is stopping")
            if not state["ended"]:
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await _answer(APIError(503, "the server is shutting down; retry on another replica",
                                           "server_error", code="shutting_down"), state, send)


async def _answer(e: BaseException, state: dict, send) -> None:
    try:
        if not state["started"]:
            err = api_error_of(e)
            body = json.dumps(err.body(), ensure_ascii=False).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            headers += [(k.lower().encode(), str(v).encode()) for k, v in err.headers.items()]
            await send({"type": "http.response.start", "status": err.status, "headers": headers})
            await send({"type": "http.response.body", "body": body})
        else:
            await send({"type": "http.response.body", "body": sse_error(e) if state["sse"] else b""})
    except Exception:  # noqa: BLE001 - the client has gone: nobody to tell
        log.debug("could not answer a failed request", exc_info=True)
