"""One request through the cluster, as the router sees it: route, stream token ids from the
decode worker, detokenize incrementally, apply stop strings, record latencies.

`start()` waits for the first token before anything is sent to the client, so that errors
raised before it (bad request, no worker, failed hand-off) still become proper HTTP errors.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field

import grpc

from pdserve.common.detokenizer import IncrementalDetokenizer
from pdserve.common.outputs import TokenLogprobs
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.tokenizer import Tokenizer
from pdserve.protos.convert import logprob_from_proto
from pdserve.protos.status import invalid_details, refused_by
from pdserve.protos.tracing import NO_SPAN, OFF, Tracer

from .cluster import ClusterClient
from .errors import APIError
from .metrics import RouterMetrics
from .policies import NoWorkerError

# a trace's root span, by id prefix
ENDPOINTS = {"cmpl": "completions", "chatcmpl": "chat.completions", "resp": "responses"}

# a decode worker that died or restarted, as opposed to a request it refused
_WORKER_FAILURES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN,
                    grpc.StatusCode.INTERNAL, grpc.StatusCode.ABORTED}
_GRPC_TO_HTTP = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.UNAUTHENTICATED: 500,
                 grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.DEADLINE_EXCEEDED: 504}


def api_error_from_grpc(e: grpc.aio.AioRpcError, prompt_param: str = "prompt") -> APIError:
    """A worker's error as the API's. A refused request keeps the field and code the worker
    named; `prompt_param`: what the client called the prompt ("messages" for chat)."""
    status = _GRPC_TO_HTTP.get(e.code(), 503)
    kind = "invalid_request_error" if status == 400 else "server_error"
    param, code = invalid_details(e) if e.code() == grpc.StatusCode.INVALID_ARGUMENT else (None, None)
    return APIError(status, e.details() or e.code().name, kind, param=prompt_param if param == "prompt" else param,
                    code=code)


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] = field(default_factory=list)


class Generation:
    def __init__(self, cluster: ClusterClient, tokenizer: Tokenizer, metrics: RouterMetrics,
                 prompt: list[int], params: SamplingParams, prefix: str = "cmpl", timeout_s: float = 0.0,
                 on_done=None, tracer: Tracer = OFF, session: str = "", on_first=None, arrival: float | None = None,
                 lora: str = "", usage: tuple = ("", True, None)):
        """arrival: when its request arrived (time.perf_counter(); default: now): its queue
        time, TTFT and deadline count from there, for every choice of the request alike.
        timeout_s > 0: the request fails with 504 (and is aborted) if it is not done by then.
        on_done: called once when the request ends, however it ends; on_first: once, when its
        first token arrives (with the time to it). tracer: the request's trace (a root span
        here, the workers' spans under it). session: its conversation (kept on one decode
        worker until that one is saturated). lora: the adapter it runs under ("": the base model).
        usage: (the operator key's name, whether this choice counts the prompt and the request:
        the first of n does, and the request's Meter or None) for the usage series, the usage
        store and the key's rate limits."""
        self.cluster, self.tokenizer, self.metrics = cluster, tokenizer, metrics
        self.prompt, self.params = prompt, params
        self.request_id = f"{prefix}-{uuid.uuid4().hex}"
        self.prompt_param = "messages" if prefix == "chatcmpl" else "prompt"  # the client's name for it
        self.created = int(time.time())
        self.detok = IncrementalDetokenizer(tokenizer, params.stop, min_tokens=params.min_tokens)
        self.finish_reason: str | None = None
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.t_arrival = time.perf_counter() if arrival is None else arrival
        self._stream = None
        self._first = None
        self._t_last = 0.0
        self.ttft = 0.0
        self.timeout_s = timeout_s
        self._on_done, self._on_first = on_done, on_first
        self.session, self.lora, self.charged = session, lora, usage
        self.generated: list[int] = []   # token ids streamed so far (replayed on migration)
        self.prompt_logprobs: list[TokenLogprobs] = []  # prompt tokens 1.., when asked for
        self.route = None
        self.migrations = 0
        self.max_migrations = 2
        self._failed: set[str] = set()
        self.t_routed = 0.0  # when its first route was chosen
        self.t_done = 0.0  # when it finished
        self.handoff = None  # its HandoffTiming, when its prompt was prefilled remotely
        self.tracer = tracer
        self.span = tracer.start(ENDPOINTS.get(prefix, prefix), kind="server", start_s=self.t_arrival,
                                 attributes={"pdserve.request_id": self.request_id,
                                             "pdserve.prompt_tokens": len(prompt),
                                             "pdserve.max_tokens": params.max_tokens})
        self._call = NO_SPAN  # the span of the call to the decode worker

    async def start(self) -> None:
        try:
            await self._open()
        except BaseException:
            await self.close()  # releases the admission slot on every failure path
            raise

    async def _open(self) -> None:
        refused: set[str] = set()  # workers whose queue is full: try the others of their pool
        await self.cluster.held.wait(len(self.prompt), self.params.priority)  # while every place is busy
        while True:
            self.cluster.release(self.route)  # a refused route's prefill never ran, its stream ended
            try:
                self.route = self.cluster.route(self.prompt, exclude=frozenset(refused),
                                                cache_salt=self.params.cache_salt, session=self.session,
                                                priority=self.params.priority, lora=self.lora)
            except NoWorkerError as e:
                if refused:
                    self.metrics.rejected.labels("pool_full").inc()
                    self.metrics.requests.labels("rejected").inc()
                    raise APIError(429, f"the cluster is at capacity (queue limit reached on {', '.join(sorted(refused))}"
                                        "); retry shortly", "rate_limit_error", code="rate_limit_exceeded",
                                   headers={"Retry-After": "1"}) from e
                raise APIError(503, str(e), "server_error", code="no_worker") from e
            if not refused:
                self.t_routed = time.perf_counter()
                self.metrics.queue.observe(self.t_routed - self.t_arrival)
                self.tracer.record("router.admission", self.span, self.t_arrival, self.t_routed)
            self._stream = self.cluster.generate(self.route, self.request_id, self.prompt, self.params,
                                                 metadata=self._trace_call(), lora=self.lora)
            try:
                self._first = await self._next()
                self.cluster.settle(self.route, self._first.prefilled_remotely)
                self.handoff = self._first.timing if self._first.HasField("timing") else None
                if self._first.kv_bytes:
                    self.metrics.kv_request_bytes.observe(self._first.kv_bytes)
                if self._first.HasField("timing"):
                    self.metrics.handoff(self._first.timing)
                self.metrics.placements.labels(self.route.placement).inc()  # its prompt is computed
                break
            except StopAsyncIteration as e:
                raise APIError(503, "the decode worker ended the request without output", "server_error") from e
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise api_error_from_grpc(e, self.prompt_param) from e
                refused.add(refused_by(e) or self.route.decode.worker_id)
                stream, self._stream = self._stream, None
                await stream.aclose()
        self._t_last = time.perf_counter()
        self.ttft = self._t_last - self.t_arrival
        self.metrics.first_token(self.ttft, len(self.prompt))
        if self._on_first is not None:
            self._on_first(self.ttft)
            self._on_first = None

    async def deltas(self):
        """Yield `Delta`s until the request finishes; then `finish_reason` is set."""
        msg = self._first
        try:
            while msg is not None:
                delta = self._consume(msg)
                if delta.text or delta.token_ids:
                    yield delta
                if self.finish_reason is not None:
                    break
                try:
                    msg = await self._next()
                except StopAsyncIteration:
                    self.finish_reason = self.finish_reason or "abort"
                    break
                now = time.perf_counter()
                self.metrics.token_gap(now - self._t_last)
                self._t_last = now
        except grpc.aio.AioRpcError as e:
            self.finish_reason = "error"
            raise api_error_from_grpc(e, self.prompt_param) from e
        finally:
            await self.close()
            self._record()

    async def _next(self):
        """The next worker message; if the decode worker fails, the request moves to another
        one, which recomputes prompt + the tokens streamed so far and continues."""
        while True:
            try:
                return await self._next_from_worker()
            except grpc.aio.AioRpcError as e:
                if e.code() not in _WORKER_FAILURES or self.migrations >= self.max_migrations:
                    raise
                await self._migrate(e)

    async def _migrate(self, e: grpc.aio.AioRpcError) -> None:
        self.cluster.release(self.route)
        failed = self.route.decode.worker_id
        self._failed.add(failed)
        self.cluster.healthy[failed] = False  # until its next successful stats poll
        old, self._stream = self._stream, None
        await old.aclose()
        try:
            self.route = self.cluster.route(self.prompt, exclude=frozenset(self._failed),
                                             cache_salt=self.params.cache_salt, session=self.session,
                                             priority=self.params.priority, lora=self.lora)
            if self.generated:  # recomputed (prompt + tokens so far) on its decode worker; else its
                self.cluster.settle(self.route, prefilled_remotely=False)  # first token settles it
        except NoWorkerError as no:
            raise APIError(503, f"decode worker {failed} failed ({e.code().name}) and no other decode worker "
                                "is available", "server_error", code="worker_failed") from no
        self.migrations += 1
        self.metrics.migrations.inc()
        self._stream = self.cluster.generate(self.route, f"{self.request_id}-m{self.migrations}", self.prompt,
                                             self.params, resume=self.generated,
                                             metadata=self._trace_call(failed), lora=self.lora)

    async def _next_from_worker(self):
        """The next worker message, within the request's deadline."""
        if not self.timeout_s:
            return await anext(self._stream)
        remaining = self.t_arrival + self.timeout_s - time.perf_counter()
        try:
            # asyncio.timeout, not wait_for: on 3.11 wait_for can drop a client's cancel (common/aio.py)
            async with asyncio.timeout(max(remaining, 0.001)):
                return await anext(self._stream)
        except asyncio.TimeoutError as e:
            self.finish_reason = "timeout"
            raise APIError(504, f"the request did not finish within {self.timeout_s:g}s and was aborted",
                           "timeout_error", code="timeout") from e

    def _consume(self, msg) -> Delta:
        ids = list(msg.token_ids)
        if msg.prompt_logprobs:
            self.prompt_logprobs = [logprob_from_proto(lp) for lp in msg.prompt_logprobs]
        self.generated += ids
        self.completion_tokens += len(ids)
        self.cached_tokens = max(self.cached_tokens, msg.num_cached_tokens)
        text = self.detok.push(ids)
        if self.detok.stopped_on is not None:
            self.finish_reason = "stop"  # closing the stream cancels the request on the worker
        elif msg.finished:
            text += self.detok.flush()
            self.finish_reason = msg.finish_reason or "stop"
        return Delta(text, ids, [logprob_from_proto(lp) for lp in msg.logprobs])

    def timing(self) -> dict:
        """Where its time went, in seconds: the router's admission, then (prefilled remotely)
        the decode worker's wait for blocks, the prefill queue, compute and KV push, the
        time to its first token, and to its end."""
        first, h = self._first, self.handoff
        out = {"queue_s": max(self.t_routed - self.t_arrival, 0.0) if self.t_routed else 0.0,
               "prefilled_remotely": bool(first is not None and first.prefilled_remotely),
               "decode_worker": self.route.decode.worker_id if self.route else "",
               "prefill_worker": self.route.prefill.worker_id if self.route and self.route.prefill else ""}
        if h is not None:
            out |= {"blocks_wait_s": h.blocks_wait_s, "prefill_queue_s": h.prefill_queue_s,
                    "prefill_compute_s": h.prefill_compute_s, "kv_push_s": h.kv_push_s,
                    "kv_bytes": first.kv_bytes}
        return out | {"ttft_s": self.ttft, "e2e_s": (self.t_done or time.perf_counter()) - self.t_arrival,
                      "migrations": self.migrations}

    def _record(self) -> None:
        self.t_done = time.perf_counter()
        self.metrics.finished(time.perf_counter() - self.t_arrival, self.ttft, self.completion_tokens,
                              self.finish_reason or "error", self.lora)
        key, first, meter = self.charged
        prompted = first and self._first is not None  # its prompt was computed (or found cached)
        used = (len(self.prompt) if prompted else 0, self.cached_tokens if prompted else 0, self.completion_tokens,
                int(prompted))
        self.metrics.usage(self.params.tenant, key, self.lora, *used)
        if meter is not None:  # router/usage.py: kept for charge-back, and the key's token count
            meter.add(self.params.tenant, key, self.lora or self.metrics.model_name, *used)

    def _trace_call(self, migrated_from: str = "") -> tuple:
        """A span for the call to the route's decode worker (the last one ended); the
        call's metadata, which makes it the parent of the workers' spans."""
        self._call.end()
        route = self.route
        attributes = {"pdserve.decode_worker": route.decode.worker_id,
                      "pdserve.prefill_worker": route.prefill.worker_id if route.prefill else ""}
        if migrated_from:
            attributes["pdserve.migrated_from"] = migrated_from
        self._call = self.tracer.start("router.generate", self.span, kind="client", attributes=attributes)
        return self.tracer.metadata(self._call)

    def _trace_end(self) -> None:
        self._call.end()
        self.span.set_attributes({"pdserve.completion_tokens": self.completion_tokens,
                                  "pdserve.cached_tokens": self.cached_tokens, "pdserve.ttft_s": self.ttft,
                                  "pdserve.finish_reason": self.finish_reason or "error",
                                  "pdserve.migrations": self.migrations})
        if self.finish_reason in (None, "error", "timeout", "abort"):
            self.span.record_error(self.finish_reason or "error")
        self.span.end()
        self._call = self.span = NO_SPAN

    async def close(self) -> None:
        # the bookkeeping first, in case closing the stream is cut short (a cancelled cleanup)
        self.cluster.release(self.route)
        if self._on_done is not None:
            done, self._on_done = self._on_done, None
            done()
        if self.span is not NO_SPAN:
            self._trace_end()
        if self._stream is not None:
            stream, self._stream = self._stream, None
            await stream.aclose()

    def usage(self) -> dict:
        u = {"prompt_tokens": len(self.prompt), "completion_tokens": self.completion_tokens,
             "total_tokens": len(self.prompt) + self.completion_tokens}
        if self.cached_tokens:
            u["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return u
