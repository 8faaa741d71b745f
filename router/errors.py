"""The API's errors: `APIError` is what every handler raises, answered as OpenAI's
`{"error": {"message", "type", "param", "code"}}`; request-validation and Starlette errors are
turned into the same shape."""
from __future__ import annotations

from typing import Any


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
