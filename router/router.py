"""The router's request handling: an OpenAI request becomes n `Generation`s (choices) per
prompt (completions take a batch of prompts), admitted against the in-flight limit, whose
deltas are formatted as completions or chat completions, streamed (SSE) or collected.

n > 1 shares the prompt: the first choice runs ahead until its first token, so its prompt
blocks are in the prefix caches (prefill and decode side) and the other choices reuse them by
reference count; each choice then computes only the prompt's last, partial block and its own
tokens. Seeded choices use seed, seed+1, ... so that they differ and are reproducible.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import replace

from pdserve.config import ClusterConfig, RouterConfig, SecurityConfig
from pdserve.common.aio import stop_tasks
from pdserve.common.errors import InvalidRequestError
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.tokenizer import Tokenizer
from pdserve.common.tokens import check_token_ids
from pdserve.protos.tracing import OFF, Tracer

from . import responses
from .adapters import AdapterAdmin, resolve_model
from .admission import AdmissionQueue, QueueRefusal
from .cluster import ClusterClient, WorkerEndpoint
from .control import PoolControl
from .discovery import RegistryDiscovery
from .tenancy import RequestContext, TenantLimits
from .errors import APIError
from .generation import Delta, Generation
from .metrics import RouterMetrics
from .protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .tools import parse_tool_call, render_messages


class Router:
    def __init__(self, cluster: ClusterClient, tokenizer: Tokenizer, config: RouterConfig | None = None,
                 security: SecurityConfig | None = None, discovery: RegistryDiscovery | None = None,
                 tracer: Tracer = OFF, control: PoolControl | None = None):
        """discovery: keeps `cluster` in step with Redis (None: the worker list is static).
        tracer: each request's trace (its owner shuts it down). control: the pools this router
        runs beside (`pdserve up`), for the admin endpoints and the autoscaler."""
        self.config = config = config or RouterConfig()
        self.security = security or SecurityConfig()
        self.cluster, self.tokenizer = cluster, tokenizer
        self.model_name = config.model_name or "default"
        self.discovery = discovery
        self.tracer = tracer
        self.refresh_interval_s = config.refresh_interval_s
        self.metrics = RouterMetrics(self.model_name, held=getattr(cluster, "held", None))
        self.logprobs = responses.Logprobs(tokenizer)
        self.admission = AdmissionQueue(config.max_inflight, config.queue_size, config.queue_timeout_s)
        self.started = time.time()  # the model card's `created`
        self.control = control
        self.adapters = AdapterAdmin(cluster)  # runtime loads and unloads of LoRA adapters
        self.tenants = TenantLimits(config.tenant_max_inflight, config.tenant_max_queued_tokens)

    @classmethod
    def from_config(cls, config: ClusterConfig, tokenizer: Tokenizer, control: PoolControl | None = None,
                    workers: list[WorkerEndpoint] | None = None) -> "Router":
        """The router of `config`'s cluster: its workers from the registry (or the static
        `workers` when the cluster has none), its traces to the configured collector."""
        cache = config.engine.cache
        cluster = ClusterClient.from_config(config.router, config.security, cache.block_size, cache.cache_namespace)
        discovery = None
        if config.registry.redis_url:
            discovery = RegistryDiscovery(config.registry.redis_url, config.registry.cluster_name, cluster)
        else:
            cluster.set_workers(workers or [])
        return cls(cluster, tokenizer, config.router, config.security, discovery=discovery,
                   tracer=Tracer(config.tracing.otlp_traces_endpoint, "pdserve-router"), control=control)

    async def refresh_forever(self) -> None:
        """Keep the view of the workers fresh: membership and KV events from the registry (if
        any), then every worker's load, every `refresh_interval_s`."""
        while True:
            if self.discovery is not None:
                await self.discovery.sync()
            await self.cluster.refresh()
            await self.adapters.reconcile()
            await asyncio.sleep(self.refresh_interval_s)

    async def close(self) -> None:
        """Close the connections to the workers and the registry."""
        await self.cluster.close()
        if self.discovery is not None:
            await self.discovery.close()

    def _stall(self) -> dict:
        """How a stream treats a client that stops reading (responses.stream)."""
        return {"stall_timeout_s": self.config.stream_stall_timeout_s,
                "on_stall": self.metrics.stalled_streams.inc}

    # ---- admission ----------------------------------------------------------------------
    @property
    def inflight(self) -> int:
        """Generations (choices) admitted and not done."""
        return self.admission.inflight

    async def _enter(self, ctx: RequestContext, places: int) -> None:
        """Take `places` of the router's places in flight (one per choice), waiting in its
        queue behind more urgent requests (router/admission.py); 429 if it is full, or after
        --queue-timeout. A sheddable request is refused before it waits."""
        self._check_shed(ctx)
        band = self._band(ctx.priority)
        self.metrics.router_queue.labels(band).inc()
        try:
            await self.admission.enter(ctx.priority, ctx.tenant, places)
        except QueueRefusal as e:
            self.metrics.requests.labels("rejected").inc()
            self.metrics.rejected.labels("router_inflight").inc()
            raise APIError(429, f"the server is at capacity ({self.config.max_inflight} generations in flight): "
                                f"{e}; retry shortly", "rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": "1"}) from None
        finally:
            self.metrics.router_queue.labels(band).dec()

    def _check_shed(self, ctx: RequestContext) -> None:
        if ctx.priority >= self.config.sheddable_priority and self.cluster.saturated(self.config.session_kv_limit):
            self.metrics.requests.labels("rejected").inc()
            self.metrics.budget_refusals.labels("shed").inc()
            raise APIError(429, f"the cluster is saturated and this request's priority ({ctx.priority}) is "
                                f"sheddable (>= {self.config.sheddable_priority}); retry later", "rate_limit_error",
                           code="shed", headers={"Retry-After": "2"})

    def _generation(self, prompt: list[int], params: SamplingParams, prefix: str,
                    ctx: RequestContext = RequestContext(), arrival: float | None = None,
                    first: bool = True) -> Generation:
        """Make a Generation in a place taken by `_enter` (given back when it is done), or
        refuse it with 429: a sheddable request while the pool is saturated, its tenant's
        limits."""
        self._check_shed(ctx)
        try:
            self.tenants.admit(ctx.tenant, len(prompt))
        except APIError as e:
            self.metrics.requests.labels("rejected").inc()
            self.metrics.budget_refusals.labels(e.code.removesuffix("_limit")).inc()
            raise
        if ctx.priority == 0:  # the default: the tenant served less goes first
            ctx = replace(ctx, priority=self.tenants.fair_priority(ctx.tenant))
        band = self._band(ctx.priority)
        labels = (band, self.metrics.tenant_label(ctx.tenant))
        self.metrics.class_waiting.labels(*labels).inc()
        waiting = [True]

        def on_first(ttft_s: float) -> None:
            waiting[0] = False
            self.metrics.class_waiting.labels(*labels).dec()
            self.metrics.class_wait.labels(*labels).observe(ttft_s)
            self.tenants.first_token(ctx.tenant, len(prompt))

        def done():
            self.admission.leave(ctx.tenant)
            if waiting[0]:
                waiting[0] = False
                self.metrics.class_waiting.labels(*labels).dec()
                self.tenants.first_token(ctx.tenant, len(prompt))
            self.tenants.done(ctx.tenant)
        params = replace(params, priority=ctx.priority, tenant=ctx.tenant)
        return Generation(self.cluster, self.tokenizer, self.metrics, prompt, params, prefix,
                          timeout_s=self.config.request_timeout_s, on_done=done, tracer=self.tracer,
                          session=ctx.session, on_first=on_first, arrival=arrival, lora=ctx.lora,
                          usage=(ctx.key, first, ctx.meter))

    def _band(self, priority: int) -> str:
        if priority >= self.config.sheddable_priority:
            return "sheddable"
        return "high" if priority < 0 else "default" if priority == 0 else "low"

    def check_model(self, model: str) -> str:
        """The LoRA adapter `model` names ("": the base model); 404 naming the served ones."""
        return resolve_model(model, self.model_name, self.cluster.adapters())

    def _check_fits(self, choices: int, param: str) -> None:
        """A request needing more generations than the router ever admits at once can never
        succeed: a 400 naming the field, not a 429 that would have the client retry forever."""
        limit = self.config.max_inflight
        if limit and choices > limit:
            raise APIError(400, f"this request needs {choices} generations at once; this server admits at most "
                                f"{limit}", param=param)

    def _check_structured(self, params: SamplingParams) -> None:
        if params.structured is not None:  # a bad schema is a 400 here, before any worker sees it
            try:
                self.tokenizer.grammar_compiler(self.tokenizer.vocab_size).check(params.structured)
            except InvalidRequestError as e:
                raise APIError(400, str(e), param=e.param) from e

    # ---- prompts ------------------------------------------------------------------------
    def _check_length(self, ids: list[int], which: str, param: str) -> None:
        """A prompt no worker can hold is a 400 at once, before it is hashed or sent."""
        limit = self.cluster.max_model_len()
        if limit and len(ids) >= limit:
            raise APIError(400, f"{which} has {len(ids)} tokens; this model's context length is {limit} tokens, "
                                "which leaves no room to generate: shorten the prompt", param=param,
                           code="context_length_exceeded")

    def _check_chars(self, chars: int, which: str, param: str) -> None:
        """A text that cannot fit even at the longest token per token (with a margin of 2 for
        normalizers) is refused before it is tokenized: a few MB of prompt would otherwise hold
        a tokenizer thread for seconds."""
        limit = self.cluster.max_model_len()
        if limit and chars > 2 * self.tokenizer.max_token_chars * limit:
            self.metrics.budget_refusals.labels("prompt_chars").inc()
            raise APIError(400, f"{which} has {chars} characters, more than this model's context of {limit} tokens "
                                "can hold: shorten it", param=param, code="context_length_exceeded")

    async def _encode_prompts(self, req: CompletionRequest) -> list[list[int]]:
        """Every prompt of the request as token ids (checked: non-empty, in the vocabulary).
        Text is tokenized off the event loop, so other streams and /health go on meanwhile."""
        out = []
        for k, p in enumerate(req.prompts()):
            which = f"prompt {k}" if len(req.prompts()) > 1 else "prompt"
            if isinstance(p, str):
                self._check_chars(len(p), which, "prompt")
                ids = await asyncio.to_thread(self.tokenizer.encode, p)
            else:
                ids = list(p)
            if not ids:
                raise APIError(400, f"{which} is empty", param="prompt")
            self._check_length(ids, which, "prompt")
            check_token_ids(ids, self.tokenizer.vocab_size, "prompt", which)
            out.append(ids)
        return out

    async def _chat_ids(self, req: ChatCompletionRequest | TokenizeRequest) -> list[int]:
        """A chat request's prompt as the model sees it: messages (and tools) through the
        chat template, tokenized (off the event loop). `/tokenize` uses the same, so its count
        is the one billed."""
        messages = [{"role": m.role, "content": m.text()} | (m.model_extra or {}) for m in req.messages]
        self._check_chars(sum(len(m["content"] or "") for m in messages), "the conversation", "messages")
        return await asyncio.to_thread(self._render_chat, req, messages)

    def _render_chat(self, req: ChatCompletionRequest | TokenizeRequest, messages: list[dict]) -> list[int]:
        messages = render_messages(messages, req.tools, req.tool_choice)
        return self.tokenizer.encode_chat(messages, add_generation_prompt=req.add_generation_prompt,
                                          special_tokens_in_content=self.config.special_tokens_in_content)

    # ---- choices ------------------------------------------------------------------------
    async def _start_choices(self, ids: list[int], params: SamplingParams, n: int, prefix: str,
                             ctx: RequestContext = RequestContext(), arrival: float | None = None) -> list[Generation]:
        """n choices of one prompt (queued under its key's limits). The first runs ahead and alone
        computes the prompt's logprobs (`echo`), which the others share, or else its prompt blocks,
        which they reuse. Every choice's queue time and TTFT count from the request's `arrival`."""
        arrival = time.perf_counter() if arrival is None else arrival
        self._check_structured(params)
        turn_ends = [t for t in self.tokenizer.end_of_turn_ids if t not in params.stop_token_ids]
        if turn_ends and not params.ignore_eos:  # as the model's EOS: a turn ends there, not shown
            params = replace(params, stop_token_ids=list(params.stop_token_ids) + turn_ends)
        self._check_fits(n, "n")
        if ctx.meter is not None:
            await ctx.meter.admit(len(ids))  # 429 past the key's queued-tokens limit
        await self._enter(ctx, n)
        gens: list[Generation] = []
        try:
            gens.append(self._generation(ids, params, prefix, ctx, arrival))
            await gens[0].start()  # runs ahead: the prompt's blocks are cached for the others
            rest = replace(params, prompt_logprobs=None)
            for i in range(1, n):  # seeds wrap within the wire's range: any valid seed serves any n
                gens.append(self._generation(ids, replace(rest, seed=(params.seed + i) % 2**63)
                                             if params.seed is not None else rest, prefix, ctx, arrival, first=False))
            await asyncio.gather(*(g.start() for g in gens[1:]))
        except BaseException:
            self.admission.leave(ctx.tenant, n - len(gens))  # the places of choices never made
            await asyncio.gather(*(g.close() for g in gens), return_exceptions=True)
            raise
        return gens

    async def _start_batch(self, prompts: list[list[int]], params: SamplingParams, n: int, prefix: str,
                           ctx: RequestContext = RequestContext(), arrival: float | None = None) -> list[Generation]:
        """n choices of every prompt, started together; prompt-major (choice k*n + j is the
        j-th of prompt k), as OpenAI numbers them. The first prompt that cannot start fails
        the request at once: the others are cancelled and every started choice is closed."""
        self._check_fits(len(prompts) * n, "prompt" if len(prompts) > 1 else "n")
        if len(prompts) == 1:
            return await self._start_choices(prompts[0], params, n, prefix, ctx, arrival)
        tasks = [asyncio.ensure_future(self._start_choices(ids, params, n, prefix, ctx, arrival)) for ids in prompts]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for t in tasks:
                if t.done() and t.exception() is not None:
                    raise t.exception()
            return [g for t in tasks for g in t.result()]
        except BaseException:
            await stop_tasks(*tasks)  # a cancelled group closes the choices it started itself
            started = [g for t in tasks if t.done() and not t.cancelled() and t.exception() is None
                       for g in t.result()]
            await asyncio.gather(*(g.close() for g in started), return_exceptions=True)
            raise

    # ---- endpoints ----------------------------------------------------------------------
    async def tokenize(self, req: TokenizeRequest) -> dict:
        """vLLM's `/tokenize`: a prompt, or chat messages (+ tools), as token ids."""
        if req.model is not None:
            self.check_model(req.model)
        req.check_supported()
        if req.messages is not None:
            ids = await self._chat_ids(req)
        else:
            self._check_chars(len(req.prompt), "prompt", "prompt")
            ids = await asyncio.to_thread(self.tokenizer.encode, req.prompt)
        return {"count": len(ids), "tokens": ids}

    async def detokenize(self, req: DetokenizeRequest) -> dict:
        if req.model is not None:
            self.check_model(req.model)
        check_token_ids(req.tokens, self.tokenizer.vocab_size, "tokens")
        return {"prompt": self.tokenizer.decode(req.tokens)}

    async def completions(self, req: CompletionRequest, timing: bool = False, ctx: RequestContext | None = None):
        """timing: each choice's time breakdown in the response (also `stream_options.include_timing`);
        ctx: its priority, tenant and session (default: the body's priority)."""
        arrival = time.perf_counter()
        req.check_supported()
        ctx = replace(ctx or RequestContext(req.priority), lora=self.check_model(req.model))
        prompts = await self._encode_prompts(req)
        gens = await self._start_batch(prompts, req.sampling_params(self.tokenizer.vocab_size), req.n, "cmpl",
                                       ctx, arrival)
        base = {"id": gens[0].request_id, "object": "text_completion", "created": gens[0].created,
                "model": req.model}
        want_lp = req.logprobs is not None
        ids_of = [ids for ids in prompts for _ in range(req.n)]  # choice i's prompt
        echo_of = [e for ids in prompts for e in [self.tokenizer.decode(ids) if req.echo else ""] * req.n]
        if req.stream:
            echoed = [not e for e in echo_of]

            def chunk(i: int, d: Delta, offset: int) -> dict:
                text = d.text if echoed[i] else echo_of[i] + d.text
                lp = self.logprobs.completion(d, len(echo_of[i]) + offset) if want_lp else None
                if lp is not None and not echoed[i]:
                    lp = {k: v + lp[k] for k, v in self.logprobs.echo(ids_of[i], gens[i - i % req.n]).items()}
                echoed[i] = True
                return base | {"choices": [{"index": i, "text": text, "finish_reason": None, "logprobs": lp}]}

            def final(i: int) -> list[dict]:
                return [base | {"choices": [{"index": i, "text": "", "logprobs": None,
                                             "finish_reason": gens[i].finish_reason}]}]
            return await responses.stream(gens, chunk, final, base, req.include_usage(), req.n, **self._stall(),
                                          include_timing=timing or req.include_timing())
        lps = [{"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []} for _ in gens]

        def on_delta(i: int, d: Delta, offset: int) -> None:
            if want_lp:
                for k, v in self.logprobs.completion(d, len(echo_of[i]) + offset).items():
                    lps[i][k] += v
        texts = await responses.collect(gens, on_delta)
        if req.echo and want_lp:
            lps = [{k: v + lp[k] for k, v in self.logprobs.echo(ids_of[i], gens[i - i % req.n]).items()}
                   for i, lp in enumerate(lps)]  # the prompt's first choice computed them
        return base | {"choices": [{"index": i, "text": echo_of[i] + t, "logprobs": lps[i] if want_lp else None,
                                    "finish_reason": g.finish_reason} for i, (t, g) in enumerate(zip(texts, gens))],
                       "usage": responses.usage(gens, req.n)} | ({"timing": responses.timing(gens)} if timing else {})

    async def chat(self, req: ChatCompletionRequest, timing: bool = False, ctx: RequestContext | None = None):
        """timing, ctx: as for `completions`."""
        arrival = time.perf_counter()
        req.check_supported()
        ctx = replace(ctx or RequestContext(req.priority), lora=self.check_model(req.model))
        specs = req.tool_specs()
        ids = await self._chat_ids(req)
        self._check_length(ids, "the conversation", "messages")
        gens = await self._start_choices(ids, req.sampling_params(self.tokenizer.vocab_size), req.n, "chatcmpl",
                                         ctx, arrival)
        base = {"id": gens[0].request_id, "object": "chat.completion", "created": gens[0].created,
                "model": req.model}
        want_lp = req.logprobs
        calls_possible = bool(specs) and req.tool_choice != "none"

        def finish(i: int, text: str) -> tuple[dict, str]:
            """The message (or delta) and finish_reason of choice i, its whole text known."""
            calls = parse_tool_call(text, specs) if calls_possible else None
            if calls:
                return {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"
            return {"role": "assistant", "content": text}, gens[i].finish_reason
        if req.stream:
            return await self._stream_chat(req, gens, base | {"object": "chat.completion.chunk"}, finish,
                                           calls_possible, timing or req.include_timing())
        content_lps: list[list] = [[] for _ in gens]

        def on_delta(i: int, d: Delta, offset: int) -> None:
            if want_lp:
                content_lps[i] += self.logprobs.chat(d)["content"]
        texts = await responses.collect(gens, on_delta)
        choices = []
        for i, text in enumerate(texts):
            message, reason = finish(i, text)
            choices.append({"index": i, "message": message, "finish_reason": reason,
                            "logprobs": {"content": content_lps[i]} if want_lp else None})
        return base | {"choices": choices, "usage": responses.usage(gens)} | (
            {"timing": responses.timing(gens)} if timing else {})

    async def _stream_chat(self, req: ChatCompletionRequest, gens: list[Generation], sbase: dict, finish,
                           calls_possible: bool, timing: bool):
        """Chat choices as SSE chunks; a reply that may be a tool call is held until it is
        complete (only then is it known to be one)."""
        started, held = [False] * len(gens), [""] * len(gens)

        def chunk(i: int, d: Delta, offset: int) -> dict | None:
            if calls_possible:
                held[i] += d.text
                return None
            delta = {"content": d.text} | ({} if started[i] else {"role": "assistant"})
            started[i] = True
            return sbase | {"choices": [{"index": i, "delta": delta, "finish_reason": None,
                                         "logprobs": self.logprobs.chat(d) if req.logprobs else None}]}

        def final(i: int) -> list[dict]:
            events, reason = [], gens[i].finish_reason
            if calls_possible:
                message, reason = finish(i, held[i])
                if message.get("tool_calls"):
                    message["tool_calls"] = [c | {"index": k} for k, c in enumerate(message["tool_calls"])]
                events.append(sbase | {"choices": [{"index": i, "delta": message, "finish_reason": None,
                                                    "logprobs": None}]})
            return events + [sbase | {"choices": [{"index": i, "delta": {}, "logprobs": None,
                                                   "finish_reason": reason}]}]
        return await responses.stream(gens, chunk, final, sbase, req.include_usage(), **self._stall(),
                                      include_timing=timing)
