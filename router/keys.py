"""The operator's API keys (`--keys-file keys.toml`): who a key is, not what its client says.

Each `[[key]]` table holds the key's SHA-256 digest (never the key in clear), the tenant it
stands for, the most urgent priority it may ask for (its ceiling: a request above it is
clamped to it, or refused where `over_ceiling = "refuse"`), the models and adapters it may use
(none listed: all), and whether it may speak for others (`trusted`: a gateway's key, whose
tenant and priority headers are honoured). For example:

    [[key]]
    name = "team-a batch"          # for logs ("" : key N)
    digest = "sha256:9f86d0..."    # printf %s "$KEY" | sha256sum
    tenant = "team-a"
    priority_ceiling = 0           # the default: no queue jumping
    priority = 5                   # its requests' priority when they send none (omitted: 0)
    over_ceiling = "clamp"         # or "refuse" (403)
    models = ["SmolLM2-135M-Instruct", "sql"]
    trusted = false
    requests_per_minute = 600      # limits (0: none), counted in the cluster's Redis
    tokens_per_minute = 200000     # prompt + completion tokens of the requests that ended
    max_concurrent = 32
    max_queued_tokens = 8192       # prompt tokens of its requests admitted and not yet finished
    on_redis_error = "open"        # or "closed": 503 while the limits cannot be counted

    [tenants.team-a]               # limits of the tenant, counted across all its keys
    requests_per_minute = 2000
    tokens_per_minute = 1000000

A `[tenants.NAME]` table holds the same limit fields (and nothing else) for a tenant some key
stands for; every key of that tenant carries them (`APIKey.tenant_limits`). `parse` checks a
file whole and names the line of each fault; `KeyRing` keeps the last good file, reloads it when it changes (looked at once a second at most) or on `reload()` (SIGHUP),
and keeps the old keys, saying why, when the new file is bad. Pure but for the file it reads.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import time
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path

log = logging.getLogger(__name__)

LIMITS = ("requests_per_minute", "tokens_per_minute", "max_concurrent", "max_queued_tokens")
FIELDS = {"name", "digest", "tenant", "priority", "priority_ceiling", "over_ceiling", "models", "trusted",
          "on_redis_error",
          *LIMITS}
CLEAR = {"key", "api_key", "secret", "token"}  # what a key in clear would be called
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
MAX_ID = 256


class KeysFileError(ValueError):
    """The keys file cannot be used: its line and what is wrong there."""


@dataclass(frozen=True)
class Limits:
    """A key's or a tenant's rate limits (0: none)."""
    requests_per_minute: int = 0
    tokens_per_minute: int = 0
    """Prompt and completion tokens of its requests that ended in the minute."""
    max_concurrent: int = 0
    max_queued_tokens: int = 0
    """Prompt tokens of its requests admitted (tokenized) and not yet finished."""

    def __bool__(self) -> bool:
        return any((self.requests_per_minute, self.tokens_per_minute, self.max_concurrent, self.max_queued_tokens))


@dataclass(frozen=True)
class APIKey:
    name: str
    tenant: str
    priority_ceiling: int = 0
    """The most urgent (lowest) priority this key may ask for."""
    refuse_over_ceiling: bool = False
    """A request above the ceiling is refused (403), not clamped to it."""
    models: frozenset[str] = frozenset()
    """Model ids and adapter names it may use; empty: all."""
    trusted: bool = False
    """A gateway's key: the tenant and priority headers it sends are honoured."""
    requests_per_minute: int = 0
    tokens_per_minute: int = 0
    """Prompt and completion tokens of its requests that ended in the minute (0: no limit)."""
    max_concurrent: int = 0
    fail_closed: bool = False
    """When the cluster's Redis (where the limits are counted) cannot be reached: refuse (503)
    rather than serve uncounted."""
    max_queued_tokens: int = 0
    tenant_limits: Limits = Limits()
    """Its tenant's limits (a `[tenants.NAME]` table), counted across all the tenant's keys."""
    priority: int | None = None
    """Its requests' priority when they send none: the operator's, not the client's (None: the
    default, 0, where the router's fair-by-default rule applies). Never above the ceiling."""

    @property
    def limits(self) -> Limits:
        """Its own limits."""
        return Limits(self.requests_per_minute, self.tokens_per_minute, self.max_concurrent, self.max_queued_tokens)

    @property
    def limited(self) -> bool:
        return bool(self.limits or self.tenant_limits)

    def allows(self, model: str) -> bool:
        return not self.models or model in self.models


def digest(key: str) -> str:
    """The form a key is stored in: "sha256:" and its hex digest."""
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def _table_lines(text: str) -> list[int]:
    """The line (1-based) of each `[[key]]` header, in order."""
    return [i + 1 for i, line in enumerate(text.splitlines()) if line.strip().split("#")[0].strip() == "[[key]]"]


def _key(entry: dict, n: int) -> tuple[str, APIKey]:
    """One [[key]] table -> (its digest, the key); ValueError naming what is wrong."""
    clear = CLEAR & set(entry)
    if clear:
        raise ValueError(f"{sorted(clear)[0]!r} holds a key in clear: store its digest instead, "
                         "digest = \"sha256:<printf %s KEY | sha256sum>\"")
    unknown = set(entry) - FIELDS
    if unknown:
        raise ValueError(f"unknown field {sorted(unknown)[0]!r} (fields: {', '.join(sorted(FIELDS))})")
    d = entry.get("digest")
    if not isinstance(d, str) or not _DIGEST.fullmatch(d):
        raise ValueError("digest must be \"sha256:\" and 64 lowercase hex digits")
    tenant = entry.get("tenant")
    if not isinstance(tenant, str) or not tenant.strip():
        raise ValueError("a key needs its tenant (tenant = \"...\"): it is not the default tenant")
    if len(tenant) > MAX_ID:
        raise ValueError(f"tenant is longer than {MAX_ID} characters")
    ceiling = entry.get("priority_ceiling", 0)
    if not isinstance(ceiling, int) or isinstance(ceiling, bool) or abs(ceiling) > 10 ** 9:
        raise ValueError("priority_ceiling must be an integer (the most urgent priority the key may ask for)")
    priority = entry.get("priority")
    if priority is not None and (not isinstance(priority, int) or isinstance(priority, bool) or abs(priority) > 10 ** 9):
        raise ValueError("priority must be an integer (its requests' priority when they send none)")
    if priority is not None and priority < ceiling:
        raise ValueError(f"priority {priority} is more urgent than the key's priority_ceiling {ceiling}")
    over = entry.get("over_ceiling", "clamp")
    if over not in ("clamp", "refuse"):
        raise ValueError(f"over_ceiling must be \"clamp\" or \"refuse\", got {over!r}")
    models = entry.get("models", [])
    if not isinstance(models, list) or not all(isinstance(m, str) and m for m in models):
        raise ValueError("models must be a list of model ids and adapter names")
    trusted = entry.get("trusted", False)
    if not isinstance(trusted, bool):
        raise ValueError("trusted must be true or false")
    name = entry.get("name", f"key {n}")
    if not isinstance(name, str):
        raise ValueError("name must be a string")
    limits = _limits(entry)
    on_error = entry.get("on_redis_error", "open")
    if on_error not in ("open", "closed"):
        raise ValueError(f"on_redis_error must be \"open\" or \"closed\", got {on_error!r}")
    return d, APIKey(name, tenant, ceiling, over == "refuse", frozenset(models), trusted, **limits,
                     fail_closed=on_error == "closed", priority=priority)


def _limits(entry: dict) -> dict[str, int]:
    """The limit fields of a [[key]] or [tenants.NAME] table; ValueError for a bad one."""
    limits = {}
    for field in LIMITS:
        v = entry.get(field, 0)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{field} must be an integer >= 0 (0: no limit), got {v!r}")
        limits[field] = v
    return limits


def _tenants(data: dict, text: str, source: str, keys: dict[str, APIKey]) -> dict[str, APIKey]:
    """The keys with their tenants' limits (the [tenants.NAME] tables); KeysFileError naming
    the line of a bad table (an unknown field, a bad limit, a tenant no key stands for)."""
    tables = data.get("tenants", {})
    if not isinstance(tables, dict) or not all(isinstance(t, dict) for t in tables.values()):
        raise KeysFileError(f"{source}: tenants must be tables: [tenants.NAME]")
    lines = [i + 1 for i, line in enumerate(text.splitlines()) if re.match(r"\s*\[\s*tenants\s*\.", line)]
    ours = {k.tenant for k in keys.values()}
    limits: dict[str, Limits] = {}
    for n, (name, entry) in enumerate(tables.items()):
        where = f"{source} line {lines[n] if len(lines) == len(tables) else '?'} (tenant {name!r})"
        unknown = set(entry) - set(LIMITS)
        if unknown:
            raise KeysFileError(f"{where}: unknown field {sorted(unknown)[0]!r} (a tenant's fields: "
                                f"{', '.join(LIMITS)})")
        if name not in ours:
            raise KeysFileError(f"{where}: no key stands for this tenant")
        try:
            limits[name] = Limits(**_limits(entry))
        except ValueError as e:
            raise KeysFileError(f"{where}: {e}") from None
    return {d: replace(k, tenant_limits=limits[k.tenant]) if k.tenant in limits else k for d, k in keys.items()}


def parse(text: str, source: str = "keys file") -> dict[str, APIKey]:
    """digest -> key for every [[key]] of a keys file (with its tenant's limits); KeysFileError naming the line of the
    first fault (a syntax error, an unknown field, a key in clear, a digest given twice...)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise KeysFileError(f"{source}: {e}") from None
    extra = set(data) - {"key", "tenants"}
    if extra:
        raise KeysFileError(f"{source}: unknown table {sorted(extra)[0]!r}: the file holds [[key]] and "
                            "[tenants.NAME] tables only")
    entries, lines = data.get("key", []), _table_lines(text)
    if not isinstance(entries, list):
        raise KeysFileError(f"{source}: key must be an array of tables: [[key]]")
    keys: dict[str, APIKey] = {}
    for n, entry in enumerate(entries):
        where = f"{source} line {lines[n] if n < len(lines) else '?'} (key {n + 1})"
        try:
            d, key = _key(entry, n + 1)
        except ValueError as e:
            raise KeysFileError(f"{where}: {e}") from None
        if d in keys:
            raise KeysFileError(f"{where}: the same digest as {keys[d].name!r}: each key once")
        keys[d] = key
    return _tenants(data, text, source, keys)


class KeyRing:
    """The keys of a keys file, kept current: `lookup` stats the file at most once a second and
    reloads it when it changed; a bad new file keeps the keys in force (the error is logged and
    kept in `error`). The first load must succeed (KeysFileError)."""

    CHECK_S = 1.0

    def __init__(self, path: str | os.PathLike, clock=time.monotonic):
        self.path, self.clock = Path(path), clock
        self.error = ""
        self.reloads = 0
        self._stamp = self._stat()
        self.keys = self._read()
        self._checked = clock()

    def _stat(self) -> tuple[int, int]:
        try:
            st = self.path.stat()
        except OSError as e:
            raise KeysFileError(f"cannot read the keys file {self.path}: {e}") from None
        return st.st_mtime_ns, st.st_size

    def _read(self) -> dict[str, APIKey]:
        try:
            text = self.path.read_text()
        except OSError as e:
            raise KeysFileError(f"cannot read the keys file {self.path}: {e}") from None
        return parse(text, str(self.path))

    def reload(self) -> bool:
        """Read the file again now; False (the old keys kept, `error` set) when it is bad."""
        try:
            self._stamp = self._stat()
            self.keys = self._read()
        except KeysFileError as e:
            self.error = str(e)
            log.error("keys file not reloaded, the keys in force stay: %s", e)
            return False
        self.error = ""
        self.reloads += 1
        log.info("keys file %s reloaded: %d keys", self.path, len(self.keys))
        return True

    def lookup(self, bearer: str) -> APIKey | None:
        """The key a bearer token is, if it is one of the file's."""
        now = self.clock()
        if now - self._checked >= self.CHECK_S:
            self._checked = now
            try:
                changed = self._stat() != self._stamp
            except KeysFileError as e:
                changed, self.error = False, str(e)
            if changed:
                self.reload()
        # looked up by digest: how long it takes says nothing of a key (the caller does not
        # choose the digest it compares)
        return self.keys.get(digest(bearer))
