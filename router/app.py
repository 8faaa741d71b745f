"""The HTTP front end (FastAPI): the OpenAI endpoints over a `Router`, models (the base and its
LoRA adapters), tokenize, health, Prometheus metrics and the admin endpoints (workers, pools,
adapter loads, usage), behind API keys."""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import signal

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException

from pdserve.common.aio import stop_tasks
from pdserve.common.checks import MAX_JSON_DEPTH, json_depth
from pdserve.common.errors import InvalidRequestError

from .errors import APIError, ErrorBoundary, api_error_of, http_error, validation_error
from .protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .control import PoolControl, scale_sizes
from .models import ModelRouters
from .keys import KeyRing, digest
from .metering import RequestEnd, add_usage_route
from .ratelimit import MemoryCounts, RateLimiter, RedisCounts
from .usage import Meter, MemoryUsage, RedisUsage
from .responses_endpoint import add_responses_routes, request_context
from .models_responses import add_model_responses_routes
from .router import Router
from .tenancy import RequestContext, sent_priority  # noqa: F401  (RequestContext: what `context` gives the routes)


class BodyLimit:
    """ASGI middleware: a request body past `limit` bytes is answered 413 before the app reads
    it (by its Content-Length, or as the bytes of a chunked body arrive), and a body nested
    deeper than MAX_JSON_DEPTH is answered 400 before anything parses it (the parsers and
    validators behind recurse per level)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def _refuse(self, err: APIError, scope, receive, send) -> None:
        await JSONResponse(err.body(), status_code=err.status)(scope, receive, send)

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body is larger than {self.limit} bytes (--max-body-size)",
                        code="request_too_large")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if self.limit and declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            return await self._refuse(self._too_large(), scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                chunks.append(message)
                break
            size += len(message.get("body", b""))
            if self.limit and size > self.limit:
                return await self._refuse(self._too_large(), scope, receive, send)
            chunks.append(message)
            if not message.get("more_body"):
                break
        body = b"".join(m.get("body", b"") for m in chunks if m["type"] == "http.request")
        # a large body is scanned off the event loop (tens of ms per MB): other requests go on
        depth = json_depth(body) if len(body) < 1 << 16 else await asyncio.to_thread(json_depth, body)
        if depth > MAX_JSON_DEPTH:
            return await self._refuse(APIError(
                400, f"the request body is nested {depth} levels deep; at most {MAX_JSON_DEPTH} are accepted",
                param="body", code="nested_too_deeply"), scope, receive, send)

        async def replay():
            return chunks.pop(0) if chunks else await receive()
        await self.app(scope, replay, send)


async def while_connected(request: Request, work):
    """Await `work` (a request's handling) unless the client disconnects first; then it is
    cancelled, which aborts its generations on the workers: nothing runs for a client that
    has gone. (A stream, once started, watches its client itself.)"""
    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":  # the body is read: only this can come
            pass
    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            await stop_tasks(task)
        await stop_tasks(watch)
    if task.cancelled():
        return Response(status_code=499)  # nobody reads it
    return task.result()


TIMING_HEADER = "x-pdserve-timing"


def wants_timing(request: Request) -> bool:
    """`X-PDServe-Timing: 1` asks for each choice's time breakdown in the response."""
    return request.headers.get(TIMING_HEADER, "").strip().lower() in ("1", "true", "yes")


def api_key_auth(api_keys: tuple[str, ...], ring: KeyRing | None = None, admin: bool = False,
                 limiter: RateLimiter | None = None):
    """A FastAPI dependency: 401 unless `Authorization: Bearer <key>` names one of `api_keys`
    (the operator's) or a key of the keys file `ring` (kept in `request.state.api_key`, which
    then decides the request's tenant and priority); with neither, open. `admin`: a keys-file
    key must be `trusted` (403 otherwise). `limiter`: the key's rate limits are counted in
    (`request.state.ticket`; router/metering.py RequestEnd counts it out) or the request refused;
    every request gets a `request.state.meter` for its usage (router/usage.py)."""
    keys = [k.encode() for k in api_keys]

    async def authorized(request: Request) -> None:
        request.state.api_key = None
        request.state.meter = Meter()
        if not keys and ring is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        given = given.strip()
        # compare against every key in constant time: timing reveals nothing about them
        ok = False
        for k in keys:
            ok |= hmac.compare_digest(given.encode(), k)
        key = ring.lookup(given) if ring is not None and not ok and given else None
        if scheme.lower() != "bearer" or not (ok or key):
            raise APIError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")
        if admin and key is not None and not key.trusted:
            raise APIError(403, f"the key {key.name!r} may not use the admin endpoints", "permission_error",
                           code="admin_not_allowed")
        request.state.api_key = key
        if key is not None and limiter is not None and key.limited:
            ticket = request.state.ticket = await limiter.enter(digest(given)[7:23], key)
            request.state.meter.on_admit = lambda tokens: limiter.admit(ticket, tokens)
    return authorized


def refuse_cross_site(request: Request) -> None:
    """An admin action must come as JSON and not from another site: a web page the operator
    opens can send a form or text POST to a loopback server without a key (no CORS preflight
    guards those), and browsers label what a page sends (Sec-Fetch-Site)."""
    if request.headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
        raise APIError(415, "send the request as JSON (Content-Type: application/json)", param="body",
                       code="unsupported_media_type")
    if request.headers.get("sec-fetch-site", "none").lower() not in ("none", "same-origin"):
        raise APIError(403, "admin requests from a web page of another site are refused", code="cross_site")


def add_admin_routes(app: FastAPI, control: PoolControl | None, authorized) -> None:
    """GET /admin/pools and POST /admin/scale {"prefill": N, "decode": M} over a
    `PoolControl` (router/control.py; None: this process manages no pools, e.g. `pdserve router`)."""
    @app.get("/admin/pools", dependencies=[Depends(authorized)])
    async def pools():
        if control is None:
            raise APIError(404, "this router manages no pools: send it to the `pdserve up` that runs them",
                           code="no_pools")
        return {"pools": control.sizes()}

    @app.post("/admin/scale", dependencies=[Depends(authorized)])
    async def scale(request: Request):
        refuse_cross_site(request)
        if control is None:
            raise APIError(404, "this router manages no pools: send it to the `pdserve up` that runs them",
                           code="no_pools")
        try:
            sizes = scale_sizes(await request.json())
            control.check(sizes)
        except ValueError as e:
            raise APIError(400, f"bad scale request: {e}", param="body") from e
        try:
            return {"pools": await control.scale(sizes)}
        except RuntimeError as e:  # deploy.launch.PoolScaleError: new workers did not start
            raise APIError(503, str(e), "server_error", code="scale_failed") from e


def add_adapter_routes(app: FastAPI, routers: ModelRouters, authorized) -> None:
    """vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter ({"lora_name", "lora_path"},
    and "base_model_name" when several base models are served), admin-authenticated: applied
    to every worker of that base model's pools (router/adapters.py)."""
    async def body(request: Request) -> dict:
        refuse_cross_site(request)
        try:
            data = await request.json()
        except ValueError as e:
            raise APIError(400, f"the body is not JSON: {e}", param="body") from e
        keys = ("lora_name", "lora_path", "base_model_name")
        if not isinstance(data, dict) or not all(isinstance(data.get(k, ""), str) for k in keys):
            raise APIError(400, "the body is {\"lora_name\": str, \"lora_path\": str, \"base_model_name\": str}",
                           param="body")
        return data

    @app.post("/v1/load_lora_adapter", dependencies=[Depends(authorized)])
    async def load_lora_adapter(request: Request):
        data = await body(request)
        name = data.get("lora_name", "")
        router = routers.for_base(data.get("base_model_name"))
        if name in routers.routers:
            raise APIError(400, f"{name!r} is a base model's name", param="lora_name", code="invalid_adapter")
        return PlainTextResponse(await router.adapters.load(name, data.get("lora_path", "")))

    @app.post("/v1/unload_lora_adapter", dependencies=[Depends(authorized)])
    async def unload_lora_adapter(request: Request):
        data = await body(request)
        router = routers.of_adapter(data.get("lora_name", ""), data.get("base_model_name"))
        return PlainTextResponse(await router.adapters.unload(data.get("lora_name", "")))


def add_error_handlers(app: FastAPI, max_body_bytes: int) -> None:
    """Every error, ours or the framework's, answered in the OpenAI shape: the handlers below
    for the ones raised on purpose, `ErrorBoundary` (outermost) for every other exception;
    bodies past `max_body_bytes` or MAX_JSON_DEPTH refused before they are parsed."""
    app.add_middleware(BodyLimit, limit=max_body_bytes)
    app.add_middleware(ErrorBoundary)  # added last: the outermost, around BodyLimit too
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(InvalidRequestError)  # a check shared with the engine (pdserve.common)
    async def _invalid_request(request: Request, e: InvalidRequestError):
        err = api_error_of(e)
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(HTTPException)  # e.g. a body that is not UTF-8: same error shape as ours
    async def _http_error(request: Request, e: HTTPException):
        return JSONResponse(http_error(e.status_code, e.detail).body(), status_code=e.status_code, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        err = validation_error(e.errors())
        return JSONResponse(err.body(), status_code=err.status)


ADMIN_MAX_BODY_BYTES = 64 << 10  # a scale request is a few bytes


def create_admin_app(control: PoolControl, api_keys: tuple[str, ...]) -> FastAPI:
    """`pdserve up --no-router`: the pools' admin endpoints and a health probe, no API."""
    app = FastAPI(title="pdserve pools")
    authorized = api_key_auth(api_keys)
    add_error_handlers(app, ADMIN_MAX_BODY_BYTES)

    @app.get("/health")
    async def health():
        sizes = control.sizes()
        return {"status": "ok", "pools": sizes}

    add_admin_routes(app, control, authorized)
    return app


def _lifespan(router: Router | ModelRouters, ring: KeyRing | None = None):
    """While the app serves: keep the routers' view of the workers fresh (and reload the keys
    file on SIGHUP); then close them."""
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(router.refresh_forever())
        if ring is not None:
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not the main thread
                asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, ring.reload)
        try:
            yield
        finally:
            await stop_tasks(task)  # its Redis calls can drop a single cancel (common/aio.py)
            await router.close()
    return lifespan


def create_app(served: Router | ModelRouters) -> FastAPI:
    """The OpenAI API over one `Router`, or over the Routers of several base models (each
    request to the one its `model` names: router/models.py), with health, metrics and the
    admin endpoints."""
    routers = served if isinstance(served, ModelRouters) else ModelRouters([served])
    router = routers.first  # the cluster's settings (the same in every model's Router)
    ring = KeyRing(router.security.keys_file) if router.security.keys_file else None
    app = FastAPI(title="pdserve", lifespan=_lifespan(routers, ring))
    app.state.keys = ring
    add_error_handlers(app, router.config.max_body_bytes)
    discovery = router.discovery  # the cluster's Redis: every router counts the same limits
    ns = f"pdserve:{discovery.cluster_name}" if discovery else ""
    limiter = RateLimiter(RedisCounts(discovery.redis, ns) if discovery else MemoryCounts())
    usage = RedisUsage(discovery.redis, ns) if discovery else MemoryUsage()
    app.add_middleware(RequestEnd, limiter=limiter, usage=usage)
    authorized = api_key_auth(router.security.api_keys, ring, limiter=limiter)
    admin = api_key_auth(router.security.api_keys, ring, admin=True)
    add_usage_route(app, usage, admin)

    def context(req, request: Request) -> RequestContext:
        return request_context(router, request, sent_priority(req), req.user, req.model)

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(req: CompletionRequest, request: Request):
        work = routers.pick(req.model).completions(req, wants_timing(request), context(req, request))
        return await while_connected(request, work)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat(req: ChatCompletionRequest, request: Request):
        work = routers.pick(req.model).chat(req, wants_timing(request), context(req, request))
        return await while_connected(request, work)

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models():
        return {"object": "list", "data": routers.model_cards()}

    @app.get("/v1/models/{model:path}", dependencies=[Depends(authorized)])
    async def model(model: str):
        routers.pick(model).check_model(model)
        return next(c for c in routers.model_cards() if c["id"] == model)

    add_adapter_routes(app, routers, admin)

    @app.post("/tokenize", dependencies=[Depends(authorized)])
    async def tokenize(req: TokenizeRequest):
        return await routers.pick(req.model).tokenize(req)

    @app.post("/detokenize", dependencies=[Depends(authorized)])
    async def detokenize(req: DetokenizeRequest):
        return await routers.pick(req.model).detokenize(req)

    @app.get("/health")
    async def health():
        if routers.ready():
            return {"status": "ok", "workers": routers.workers()}
        return JSONResponse({"status": "unavailable", "workers": routers.workers()}, status_code=503)

    @app.get("/admin/workers", dependencies=[Depends(admin)])
    async def workers():
        return {"workers": sorted((w | {"model": name} for name, r in routers.routers.items()
                                   for w in worker_view(r.cluster)), key=lambda w: (w["model"], w["worker_id"]))}

    add_admin_routes(app, router.control, admin)
    if routers.several:
        add_model_responses_routes(app, routers, authorized, while_connected, wants_timing)
    else:
        add_responses_routes(app, router, authorized, while_connected, wants_timing)

    @app.get("/metrics")
    async def metrics():
        return Response(routers.render_metrics(), media_type="text/plain; version=0.0.4")

    return app


def worker_view(cluster) -> list[dict]:
    """What a router routes to: each worker's role, address, health and last stats."""
    out = []
    for w in cluster.workers.values():
        s = cluster.stats.get(w.worker_id)
        out.append({"worker_id": w.worker_id, "role": w.role, "address": w.address,
                    "healthy": bool(cluster.healthy.get(w.worker_id)),
                    "metrics_port": s.metrics_port if s else None,
                    "lora_adapters": [{"name": i.name, "resident": i.resident, "users": i.users} for i in s.loras]
                    if s else None,
                    "running": s.running if s else None, "waiting": s.waiting if s else None,
                    "kv_usage": s.kv_usage if s else None, "refused": s.refused if s else None,
                    "kv_tiers": {"host": {"bytes": s.kv_host_bytes, "hit_tokens": s.kv_host_hits,
                                          "stored_blocks": s.kv_host_stored},
                                 "disk": {"bytes": s.kv_disk_bytes, "hit_tokens": s.kv_disk_hits,
                                          "stored_blocks": s.kv_disk_stored, "refused": s.kv_disk_refused}}
                    if s else None,
                    "peer_pulls": {"pulls": s.peer_pulls, "blocks_pulled": s.peer_blocks_pulled,
                                   "bytes_pulled": s.peer_bytes_pulled, "failures": s.peer_pull_failures,
                                   "misses": s.peer_pull_misses, "skipped": s.peer_pull_skipped,
                                   "blocks_served": s.peer_blocks_served,
                                   "bytes_served": s.peer_bytes_served} if s else None})
    return sorted(out, key=lambda w: w["worker_id"])
