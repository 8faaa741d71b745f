"""Who a request is for and how much of the cluster it may hold: its priority, its tenant and
its session (from the body and the headers), the per-tenant limits on requests in flight and
prompt tokens queued, and session affinity (a conversation stays on the decode worker that
holds its history until that worker is saturated). Small pure parts; the router applies them."""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from .errors import APIError
from .usage import Meter

PRIORITY_HEADER = "x-pdserve-priority"
TENANT_HEADERS = ("x-pdserve-tenant", "x-llm-d-inference-fairness-id")
SESSION_HEADERS = ("x-pdserve-session", "x-session-id")
MAX_ID = 256  # characters of a tenant or session id


def key_tenant(api_key: str) -> str:
    """The tenant an API key stands for: a short digest of it (never the key itself)."""
    return "key-" + hashlib.sha256(api_key.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class RequestContext:
    priority: int = 0
    """Lower is served sooner (vLLM's `priority`); the gateway's header wins over the body's field."""
    tenant: str = ""
    session: str = ""
    lora: str = ""
    """The LoRA adapter its `model` names ("": the base model)."""
    key: str = ""
    """The name of the operator's key it came with (router/keys.py; "": none)."""
    meter: Meter | None = field(default=None, compare=False)
    """Its generations add what they used (router/usage.py: charge-back and the key's rate
    limits); None: not counted."""

    @classmethod
    def of(cls, headers: Mapping[str, str], body_priority: int = 0, user: str | None = None,
           api_key: str = "") -> "RequestContext":
        """The tenant is the API key's when keys are configured (a client cannot pose as
        another tenant), else the tenant header's; the session is the session header's, else `user`."""
        priority = body_priority
        raw = headers.get(PRIORITY_HEADER)
        if raw is not None:
            try:
                priority = int(raw)
            except ValueError:
                raise APIError(400, f"the {PRIORITY_HEADER} header must be an integer, got {raw[:40]!r}",
                               param=PRIORITY_HEADER) from None
        tenant = key_tenant(api_key) if api_key else next((headers[h] for h in TENANT_HEADERS if h in headers), "")
        session = next((headers[h] for h in SESSION_HEADERS if h in headers), "") or (user or "")
        for name, value in (("tenant", tenant), ("session", session)):
            if len(value) > MAX_ID:
                raise APIError(400, f"the {name} id is longer than {MAX_ID} characters", param=name)
        return cls(priority, tenant, session)

    @classmethod
    def for_key(cls, key, headers: Mapping[str, str], body_priority: int | None = None,
                user: str | None = None) -> "RequestContext":
        """A request under an operator's key (router/keys.py APIKey): its tenant is the key's and
        its priority the body's (None: it sent none; the key's own `priority` then, if it has
        one), held to the key's ceiling (clamped, or 403 where the key says refuse); only a
        trusted key's (a gateway's) tenant and priority headers count."""
        if not key.trusted:
            headers = {h: v for h, v in headers.items() if h.lower() not in (PRIORITY_HEADER, *TENANT_HEADERS)}
        if body_priority is None:
            body_priority = key.priority or 0
        base = cls.of(headers, body_priority, user)
        priority = base.priority
        if priority < key.priority_ceiling:
            if key.refuse_over_ceiling:
                raise APIError(403, f"priority {priority} is above what the key {key.name!r} may ask for (at most "
                                    f"{key.priority_ceiling}, lower is more urgent)", "permission_error",
                               param="priority", code="priority_not_allowed")
            priority = key.priority_ceiling
        return cls(priority, (base.tenant if key.trusted else "") or key.tenant, base.session, key=key.name)


def sent_priority(req) -> int | None:
    """A request body's `priority`, None where the client sent none (a key's own priority,
    or the default, applies then)."""
    return req.priority if "priority" in req.model_fields_set else None


class TenantLimits:
    """Per tenant: requests in flight and prompt tokens not yet answered (0: no limit). A
    request past either is refused with 429 naming the limit; the tenant's other requests go on."""

    def __init__(self, max_inflight: int = 0, max_queued_tokens: int = 0):
        self.max_inflight, self.max_queued_tokens = max_inflight, max_queued_tokens
        self.inflight: dict[str, int] = {}
        self.queued_tokens: dict[str, int] = {}

    def admit(self, tenant: str, prompt_tokens: int) -> None:
        n, q = self.inflight.get(tenant, 0), self.queued_tokens.get(tenant, 0)
        if self.max_inflight and n >= self.max_inflight:
            raise APIError(429, f"tenant {tenant or '(default)'!r} has {n} requests in flight, its limit; retry "
                                "when one finishes", "rate_limit_error", code="tenant_inflight_limit",
                           headers={"Retry-After": "1"})
        if self.max_queued_tokens and q + prompt_tokens > self.max_queued_tokens and q:
            raise APIError(429, f"tenant {tenant or '(default)'!r} has {q} prompt tokens waiting for their first "
                                f"token; this request's {prompt_tokens} would pass its limit of "
                                f"{self.max_queued_tokens}", "rate_limit_error", code="tenant_token_limit",
                           headers={"Retry-After": "1"})
        self.inflight[tenant] = n + 1
        self.queued_tokens[tenant] = q + prompt_tokens

    def fair_priority(self, tenant: str) -> int:
        """Fair by default: the priority of a request of `tenant` sent at the default (0): -1 if
        another tenant has more requests in flight (the tenant served less is the more urgent
        one, with every worker's step budget and core lending), else 0."""
        mine = self.inflight.get(tenant, 0)
        return -1 if tenant and any(n > mine for t, n in self.inflight.items() if t != tenant) else 0

    def first_token(self, tenant: str, prompt_tokens: int) -> None:
        """The request's prompt is answered: its tokens no longer count as queued."""
        left = self.queued_tokens.get(tenant, 0) - prompt_tokens
        if left > 0:
            self.queued_tokens[tenant] = left
        else:
            self.queued_tokens.pop(tenant, None)

    def done(self, tenant: str) -> None:
        left = self.inflight.get(tenant, 0) - 1
        if left > 0:
            self.inflight[tenant] = left
        else:
            self.inflight.pop(tenant, None)


class SessionAffinity:
    """Sticky until saturated: a session's requests go to the decode worker its last one went
    to while that worker is healthy and below `kv_limit` KV usage; then
    the policy picks another and the session moves there. Remembers `capacity` sessions (LRU)."""

    def __init__(self, kv_limit: float = 0.9, capacity: int = 100_000):
        self.kv_limit, self.capacity = kv_limit, capacity
        self.bound: OrderedDict[str, str] = OrderedDict()
        self.kept = self.moved = 0

    def pick(self, session: str, loads: list, choose: Callable[[], str]) -> str:
        """`loads`: the decode pool's WorkerLoads (router/policies.py); `choose`: the policy's pick."""
        if not session:
            return choose()
        wid = self.bound.get(session)
        load = next((w for w in loads if w.worker_id == wid), None)
        if load is not None and load.healthy and load.kv_usage < self.kv_limit:
            self.kept += 1
        else:
            if wid is not None:
                self.moved += 1
            wid = choose()
        self.bound[session] = wid
        self.bound.move_to_end(session)
        while len(self.bound) > self.capacity:
            self.bound.popitem(last=False)
        return wid
