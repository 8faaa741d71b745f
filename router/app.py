"""The OpenAI-compatible HTTP API (FastAPI): completions and chat completions, streaming
(SSE) and not, models, health and Prometheus metrics."""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
from dataclasses import dataclass

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from engine.tokenizer import Tokenizer

from .cluster import ClusterClient
from .generation import Delta, Generation
from .metrics import RouterMetrics
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, http_error, validation_error


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


@dataclass(frozen=True)
class RouterConfig:
    model_name: str = "default"
    """The model id clients must name."""
    refresh_interval_s: float = 0.5
    """How often worker loads (and, with a registry, membership and KV events) are read."""
    api_keys: tuple[str, ...] = ()
    """Accepted `Authorization: Bearer` keys for /v1; empty: no authentication."""
    max_inflight: int = 0
    """Requests admitted at once; beyond it 429 with Retry-After. 0: unbounded."""
    request_timeout_s: float = 0.0
    """A request not finished after this long gets 504 (and is aborted). 0: no limit."""

    def __post_init__(self):
        if self.max_inflight < 0 or self.request_timeout_s < 0:
            raise ValueError("max_inflight and request_timeout_s must be >= 0")


class Router:
    def __init__(self, cluster: ClusterClient, tokenizer: Tokenizer, config: RouterConfig | None = None,
                 discovery=None):
        """discovery: a RegistryDiscovery that keeps `cluster` in step with Redis (None:
        the worker list is static)."""
        self.config = config = config or RouterConfig()
        self.cluster, self.tokenizer, self.model_name = cluster, tokenizer, config.model_name
        self.discovery = discovery
        self.refresh_interval_s = config.refresh_interval_s
        self.metrics = RouterMetrics()
        self.inflight = 0

    def _generation(self, prompt: list[int], params, prefix: str) -> Generation:
        """Admit a request (or refuse it with 429) and make its Generation."""
        limit = self.config.max_inflight
        if limit and self.inflight >= limit:
            self.metrics.requests.labels("rejected").inc()
            self.metrics.rejected.labels("router_inflight").inc()
            raise APIError(429, f"the server is at capacity ({limit} requests in flight); retry shortly",
                           "rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": "1"})
        self.inflight += 1

        def done():
            self.inflight -= 1
        return Generation(self.cluster, self.tokenizer, self.metrics, prompt, params, prefix,
                          timeout_s=self.config.request_timeout_s, on_done=done)

    # ---- formatting ---------------------------------------------------------------------
    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _completion_logprobs(self, d: Delta, offset: int) -> dict:
        toks = [self._token_text(lp.token_id) for lp in d.logprobs]
        offsets, pos = [], offset
        for t in toks:
            offsets.append(pos)
            pos += len(t)
        return {"tokens": toks, "token_logprobs": [lp.logprob for lp in d.logprobs],
                "top_logprobs": [{self._token_text(t): v for t, v in lp.top} for lp in d.logprobs],
                "text_offset": offsets}

    def _chat_logprobs(self, d: Delta) -> dict:
        def entry(t, v):
            s = self._token_text(t)
            return {"token": s, "logprob": v, "bytes": list(s.encode())}
        return {"content": [entry(lp.token_id, lp.logprob) | {"top_logprobs": [entry(t, v) for t, v in lp.top]}
                            for lp in d.logprobs]}

    # ---- requests -----------------------------------------------------------------------
    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def _encode_prompt(self, req: CompletionRequest) -> list[int]:
        p = req.prompt
        if isinstance(p, list) and p and isinstance(p[0], str):
            p = p[0]
        ids = self.tokenizer.encode(p) if isinstance(p, str) else list(p)
        if not ids:
            raise APIError(400, "prompt is empty", param="prompt")
        vocab = self.tokenizer.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"prompt contains token id {bad}, outside the vocabulary [0, {vocab})", param="prompt")
        return ids

    async def completions(self, req: CompletionRequest):
        req.check_supported()
        self._check_model(req.model)
        ids = self._encode_prompt(req)
        gen = self._generation(ids, req.sampling_params(req.max_tokens, req.logprobs, self.tokenizer.vocab_size),
                               "cmpl")
        await gen.start()
        base = {"id": gen.request_id, "object": "text_completion", "created": gen.created, "model": self.model_name}
        want_lp = req.logprobs is not None
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)

            def chunk(d: Delta, offset: int) -> dict:
                return base | {"choices": [{"index": 0, "text": d.text, "finish_reason": None,
                                            "logprobs": self._completion_logprobs(d, offset) if want_lp else None}]}

            return await self._stream(gen, chunk, lambda: base | {"choices": [{"index": 0, "text": "", "logprobs": None,
                                                                        "finish_reason": gen.finish_reason}]},
                                base, include_usage)
        text, lps = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        async for d in gen.deltas():
            if want_lp:
                for k, v in self._completion_logprobs(d, len(text)).items():
                    lps[k] += v
            text += d.text
        return base | {"choices": [{"index": 0, "text": text, "logprobs": lps if want_lp else None,
                                    "finish_reason": gen.finish_reason}], "usage": gen.usage()}

    async def chat(self, req: ChatCompletionRequest):
        req.check_supported()
        self._check_model(req.model)
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt)
        ids = self.tokenizer.encode(prompt)
        gen = self._generation(ids, req.sampling_params(req.max_new_tokens(), req.wanted_logprobs(),
                                                      self.tokenizer.vocab_size), "chatcmpl")
        await gen.start()
        base = {"id": gen.request_id, "object": "chat.completion", "created": gen.created, "model": self.model_name}
        want_lp = req.logprobs
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            sbase = base | {"object": "chat.completion.chunk"}
            first = [True]

            def chunk(d: Delta, offset: int) -> dict:
                delta = {"role": "assistant", "content": d.text} if first[0] else {"content": d.text}
                first[0] = False
                return sbase | {"choices": [{"index": 0, "delta": delta, "finish_reason": None,
                                             "logprobs": self._chat_logprobs(d) if want_lp else None}]}

            return await self._stream(gen, chunk, lambda: sbase | {"choices": [{"index": 0, "delta": {}, "logprobs": None,
                                                                         "finish_reason": gen.finish_reason}]},
                                sbase, include_usage)
        text, content_lps = "", []
        async for d in gen.deltas():
            text += d.text
            if want_lp:
                content_lps += self._chat_logprobs(d)["content"]
        return base | {"choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                    "logprobs": {"content": content_lps} if want_lp else None,
                                    "finish_reason": gen.finish_reason}], "usage": gen.usage()}

    async def _stream(self, gen: Generation, chunk, final, base: dict, include_usage: bool) -> StreamingResponse:
        async def events():
            offset = 0
            try:
                async for d in gen.deltas():
                    yield _sse(chunk(d, offset))
                    offset += len(d.text)
                yield _sse(final())
                if include_usage:
                    yield _sse(base | {"choices": [], "usage": gen.usage()})
            except APIError as e:  # after the first byte the status is sent: report in-band
                yield _sse(e.body())
            finally:
                await gen.close()
            yield "data: [DONE]\n\n"

        # Start the generator now: a started async generator is closed (its `finally` runs,
        # aborting the request) whenever it is dropped, even if the client vanished before
        # the server began to send the body and the body was never iterated.
        inner = events()
        first = await anext(inner)

        async def body():
            yield first
            async for item in inner:
                yield item

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def create_app(router: Router) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async def refresher():
            while True:
                if router.discovery is not None:
                    await router.discovery.sync()
                await router.cluster.refresh()
                await asyncio.sleep(router.refresh_interval_s)
        task = asyncio.create_task(refresher())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await router.cluster.close()
            if router.discovery is not None:
                await router.discovery.close()

    app = FastAPI(title="pdserve", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    keys = [k.encode() for k in router.config.api_keys]

    async def authorized(request: Request) -> None:
        if not keys:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        # compare against every key in constant time: timing reveals nothing about them
        ok = False
        for k in keys:
            ok |= hmac.compare_digest(given.strip().encode(), k)
        if scheme.lower() != "bearer" or not ok:
            raise APIError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    @app.exception_handler(HTTPException)  # e.g. a body that is not UTF-8: same error shape as ours
    async def _http_error(request: Request, e: HTTPException):
        return JSONResponse(http_error(e.status_code, e.detail).body(), status_code=e.status_code, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        err = validation_error(e.errors())
        return JSONResponse(err.body(), status_code=err.status)

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(req: CompletionRequest):
        return await router.completions(req)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat(req: ChatCompletionRequest):
        return await router.chat(req)

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models():
        return {"object": "list", "data": [{"id": router.model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "pdserve"}]}

    @app.get("/health")
    async def health():
        if router.cluster.ready():
            return {"status": "ok", "workers": len(router.cluster.workers)}
        return JSONResponse({"status": "unavailable", "workers": len(router.cluster.workers)}, status_code=503)

    @app.get("/admin/workers", dependencies=[Depends(authorized)])
    async def workers():
        """What this router routes to: each worker's role, address, health and last stats."""
        out = []
        for w in router.cluster.workers.values():
            s = router.cluster.stats.get(w.worker_id)
            out.append({"worker_id": w.worker_id, "role": w.role, "address": w.address,
                        "healthy": bool(router.cluster.healthy.get(w.worker_id)),
                        "running": s.running if s else None, "waiting": s.waiting if s else None,
                        "kv_usage": s.kv_usage if s else None, "refused": s.refused if s else None})
        return {"workers": sorted(out, key=lambda w: w["worker_id"])}

    @app.get("/metrics")
    async def metrics():
        router.metrics.observe_workers(router.cluster.stats)
        return Response(router.metrics.render(), media_type="text/plain; version=0.0.4")

    return app
