"""Redis URLs and connections: every URL goes to `redis.asyncio.from_url` unchanged, so
`redis://:PASSWORD@host:6379/0`, `redis://USER:PASSWORD@...` (ACL users) and TLS
(`rediss://...?ssl_cert_reqs=required&ssl_ca_certs=/path/ca.pem`) all work; special
characters in a password must be percent-encoded. A URL is only ever logged through
`redact_url`, and Redis errors through `describe_error`, so that a password never reaches a
log."""
from __future__ import annotations

import re
from urllib.parse import unquote, unquote_plus

import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError

REDACTED = "***"
# query parameters whose values are secrets (e.g. `ssl_password`, the key file's passphrase);
# paths such as ssl_keyfile/ssl_ca_certs are not
_SENSITIVE_QUERY = ("pass", "secret", "token", "auth")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)(.*)$", re.S)


def _split_url(url: str) -> tuple[str, str | None, str]:
    """(scheme://, userinfo or None, the rest). The userinfo ends at the *last* '@', as in
    urllib, but the authority is not cut at '/', '?' or '#' first: a password with one of
    those unencoded is then still hidden whole (at worst the host is hidden too)."""
    m = _SCHEME.match(url)
    prefix, rest = (m.group(1), m.group(2)) if m else ("", url)
    userinfo, at, host = rest.rpartition("@")
    return (prefix, userinfo, host) if at else (prefix, None, rest)


def _sensitive(name: str) -> bool:
    return any(s in unquote_plus(name).lower() for s in _SENSITIVE_QUERY)


def redact_url(url: str) -> str:
    """`url` fit for a log line or an error message: the password (and secret-looking query
    values) become `***`; scheme, user name, host, port, db and other parameters stay.
    `redis://user:pw@h:6379/0` -> `redis://user:***@h:6379/0`. A user part without a ':'
    is hidden whole: people write `redis://PASSWORD@host` meaning a password."""
    prefix, userinfo, rest = _split_url(url)
    if userinfo is not None:
        user, colon, _ = userinfo.partition(":")
        rest = (f"{user}:{REDACTED}@" if colon else f"{REDACTED}@") + rest
    base, q, query = rest.partition("?")
    if q:
        query, hashmark, fragment = query.partition("#")
        parts = []
        for item in query.split("&"):
            name, eq, _ = item.partition("=")
            parts.append(f"{name}={REDACTED}" if eq and _sensitive(name) else item)
        rest = base + "?" + "&".join(parts) + hashmark + fragment
    return prefix + rest


def url_secrets(url: str) -> set[str]:
    """The secrets in a URL, as written and decoded: its password and secret query values."""
    _, userinfo, rest = _split_url(url)
    found: set[str] = set()
    if userinfo is not None:
        user, colon, password = userinfo.partition(":")
        found |= {password if colon else user}
    query = rest.partition("?")[2].partition("#")[0]
    for item in query.split("&") if query else ():
        name, eq, value = item.partition("=")
        if eq and _sensitive(name):
            found |= {value, unquote_plus(value)}
    # decoded too; and the pieces between URL delimiters, which is what urllib quotes in
    # its errors when a password has them unencoded
    found |= {unquote(s) for s in found}
    found |= {piece for s in found for piece in re.split(r"[/?#@:&=]", s)}
    return {s for s in found if s}


def redact_secrets(text, url: str) -> str:
    """str(text) with every secret of `url` replaced by `***`: for Redis errors in log lines
    (redis-py's messages carry host:port only, but a server reply or a future message might
    echo more; this makes sure)."""
    out = str(text)
    for s in sorted(url_secrets(url), key=len, reverse=True):
        out = out.replace(s, REDACTED)
    return out


def describe_error(e: BaseException, redis_url: str) -> str:
    """A Redis error for a log line: secrets of the URL removed, and a hint when the server
    refused our credentials (redis-py's wording, e.g. about HELLO, does not say so plainly)."""
    text = redact_secrets(e, redis_url)
    if isinstance(e, AuthenticationError) or "NOAUTH" in text or "WRONGPASS" in text:
        text += " (Redis authentication failed: check the password in the Redis URL)"
    return text


def connect(redis_url: str, timeout_s: float = 5.0) -> aioredis.Redis:
    """`redis.asyncio.from_url`, with a malformed URL reported without its password (urllib's
    own errors can quote part of it, e.g. an unencoded '/' makes the rest a 'port').
    Every command gives up after `timeout_s` (redis-py waits forever by default): a registry
    behind a partition, which drops packets rather than refusing them, must not stall a
    heartbeat, the router's sync, or a worker's shutdown."""
    try:
        return aioredis.from_url(redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    except ValueError as e:
        raise ValueError(f"invalid Redis URL {redact_url(redis_url)!r}: {redact_secrets(e, redis_url)} "
                         "(percent-encode special characters in the password)") from None
