"""The OpenAI endpoints' request handling: a request becomes n `Generation`s (choices) per
prompt (completions take a batch of prompts), whose deltas are formatted as completions or
chat completions, streamed (SSE) or collected.

n > 1 shares the prompt: the first choice runs ahead until its first token, so its prompt
blocks are in the prefix caches (prefill and decode side) and the other choices reuse them by
reference count; each choice then computes only the prompt's last, partial block and its own
tokens. Seeded choices use seed, seed+1, ... so that they differ and are reproducible.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import replace

from fastapi.responses import StreamingResponse

from pdserve.engine.aio import stop_tasks

from .generation import Delta, Generation
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .tools import check_tools, forced_tool, parse_tool_call, render_messages, structured_from_response_format


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _usage(gens: list[Generation], per_prompt: int | None = None) -> dict:
    """A request's usage: every choice's tokens, and each prompt's once (choices come
    `per_prompt` to a prompt, prompt-major; default: all share one prompt)."""
    firsts = [g.usage() for g in gens[::per_prompt or len(gens)]]
    prompt = sum(f["prompt_tokens"] for f in firsts)
    done = sum(g.completion_tokens for g in gens)
    u = {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}
    cached = sum(f.get("prompt_tokens_details", {}).get("cached_tokens", 0) for f in firsts)
    if cached:
        u["prompt_tokens_details"] = {"cached_tokens": cached}
    return u


class OpenAIHandlers:
    """Mixed into `Router` (router/app.py), which provides `_generation`, `tokenizer`,
    `model_name` and the admission bookkeeping."""

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

    def _echo_logprobs(self, ids: list[int], g: Generation) -> dict:
        """The prompt's tokens with their logprobs (the first token has none), for echo."""
        toks = [self._token_text(t) for t in ids]
        offsets, pos = [], 0
        for t in toks:
            offsets.append(pos)
            pos += len(t)
        return {"tokens": toks, "token_logprobs": [None] + [lp.logprob for lp in g.prompt_logprobs],
                "top_logprobs": [None] + [{self._token_text(t): v for t, v in lp.top} for lp in g.prompt_logprobs],
                "text_offset": offsets}

    def _chat_logprobs(self, d: Delta) -> dict:
        def entry(t, v):
            s = self._token_text(t)
            return {"token": s, "logprob": v, "bytes": list(s.encode())}
        return {"content": [entry(lp.token_id, lp.logprob) | {"top_logprobs": [entry(t, v) for t, v in lp.top]}
                            for lp in d.logprobs]}

    # ---- choices ------------------------------------------------------------------------
    def _check_structured(self, params) -> None:
        if params.structured is not None:  # a bad schema is a 400 here, before any worker sees it
            from pdserve.engine.errors import InvalidRequestError
            try:
                self.tokenizer.grammar_compiler(self.tokenizer.vocab_size).check(params.structured)
            except InvalidRequestError as e:
                raise APIError(400, str(e), param=e.param) from e

    def _check_fits(self, choices: int, param: str) -> None:
        """A request needing more generations than the router ever admits at once can never
        succeed: a 400 naming the field, not a 429 that would have the client retry forever."""
        limit = self.config.max_inflight
        if limit and choices > limit:
            raise APIError(400, f"this request needs {choices} generations at once; this server admits at most "
                                f"{limit}", param=param)

    async def _start_choices(self, ids: list[int], params, n: int, prefix: str) -> list[Generation]:
        self._check_structured(params)
        self._check_fits(n, "n")
        gens: list[Generation] = []
        try:
            gens.append(self._generation(ids, params, prefix))
            await gens[0].start()  # runs ahead: the prompt's blocks are cached for the others
            for i in range(1, n):
                gens.append(self._generation(ids, replace(params, seed=params.seed + i)
                                             if params.seed is not None else params, prefix))
            await asyncio.gather(*(g.start() for g in gens[1:]))
        except BaseException:
            await asyncio.gather(*(g.close() for g in gens), return_exceptions=True)
            raise
        return gens

    async def _start_batch(self, prompts: list[list[int]], params, n: int, prefix: str) -> list[Generation]:
        """n choices of every prompt, started together; prompt-major (choice k*n + j is the
        j-th of prompt k), as OpenAI numbers them. The first prompt that cannot start fails
        the request at once: the others are cancelled and every started choice is closed."""
        self._check_fits(len(prompts) * n, "prompt" if len(prompts) > 1 else "n")
        if len(prompts) == 1:
            return await self._start_choices(prompts[0], params, n, prefix)
        tasks = [asyncio.ensure_future(self._start_choices(ids, params, n, prefix)) for ids in prompts]
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

    async def _collect(self, gens: list[Generation], on_delta) -> list[str]:
        async def one(i: int, g: Generation) -> str:
            text = ""
            async for d in g.deltas():
                on_delta(i, d, len(text))
                text += d.text
            return text
        try:
            return list(await asyncio.gather(*(one(i, g) for i, g in enumerate(gens))))
        finally:
            await asyncio.gather(*(g.close() for g in gens), return_exceptions=True)

    async def _stream(self, gens: list[Generation], chunk, final, base: dict, include_usage: bool,
                      per_prompt: int | None = None) -> StreamingResponse:
        """SSE of every choice's deltas as they come; `chunk(i, delta, offset)` and `final(i)`
        give the events (or None to send nothing)."""
        async def events():
            q: asyncio.Queue = asyncio.Queue()

            async def pump(i: int, g: Generation):
                try:
                    async for d in g.deltas():
                        await q.put((i, d))
                    await q.put((i, None))
                except BaseException as e:  # noqa: BLE001 - reported in-band below
                    await q.put((i, e))
            tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
            offsets, left = [0] * len(gens), len(gens)
            try:
                while left:
                    i, item = await q.get()
                    if isinstance(item, BaseException):
                        raise item
                    if item is None:
                        left -= 1
                        for ev in final(i):
                            yield _sse(ev)
                        continue
                    ev = chunk(i, item, offsets[i])
                    offsets[i] += len(item.text)
                    if ev is not None:
                        yield _sse(ev)
                if include_usage:
                    yield _sse(base | {"choices": [], "usage": _usage(gens, per_prompt)})
            except APIError as e:  # after the first byte the status is sent: report in-band
                yield _sse(e.body())
            finally:
                await stop_tasks(*tasks)
                await asyncio.gather(*(g.close() for g in gens), return_exceptions=True)
            yield "data: [DONE]\n\n"

        # Start the generator now: a started async generator is closed (its `finally` runs,
        # aborting the requests) whenever it is dropped, even if the client vanished before
        # the server began to send the body and the body was never iterated.
        inner = events()
        first = await anext(inner)

        async def body():
            yield first
            async for item in inner:
                yield item

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def _chat_ids(self, req) -> list[int]:
        """A chat request's prompt as the model sees it: messages (and tools) through the
        chat template, tokenized. `/tokenize` uses the same, so its count is the one billed."""
        messages = render_messages([{"role": m.role, "content": m.text()} | (m.model_extra or {}) for m in req.messages],
                                   req.tools, req.tool_choice)
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt)
        return self.tokenizer.encode(prompt)

    # ---- endpoints ----------------------------------------------------------------------
    async def tokenize(self, req: TokenizeRequest) -> dict:
        """vLLM's `/tokenize`: a prompt, or chat messages (+ tools), as token ids."""
        if req.model is not None:
            self._check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give either prompt or messages", param="prompt")
        if req.messages is not None:
            if not req.messages:  # as the chat endpoint refuses it
                raise APIError(400, "messages must contain at least one message", param="messages")
            check_tools(req.tools, req.tool_choice)
            ids = self._chat_ids(req)
        else:
            ids = self.tokenizer.encode(req.prompt)
        return {"count": len(ids), "tokens": ids}

    async def detokenize(self, req: DetokenizeRequest) -> dict:
        if req.model is not None:
            self._check_model(req.model)
        vocab = self.tokenizer.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"tokens contains {bad}, outside the vocabulary [0, {vocab})", param="tokens")
        return {"prompt": self.tokenizer.decode(req.tokens)}

    async def completions(self, req: CompletionRequest):
        req.check_supported()
        self._check_model(req.model)
        prompts = self._encode_prompts(req)
        params = req.sampling_params(req.max_tokens, req.logprobs, self.tokenizer.vocab_size)
        params.structured = structured_from_response_format(req.response_format)
        if req.echo and req.logprobs is not None:
            params.prompt_logprobs = req.logprobs
        gens = await self._start_batch(prompts, params, req.n, "cmpl")
        base = {"id": gens[0].request_id, "object": "text_completion", "created": gens[0].created,
                "model": self.model_name}
        want_lp = req.logprobs is not None
        ids_of = [ids for ids in prompts for _ in range(req.n)]  # choice i's prompt
        echo_of = [e for ids in prompts for e in [self.tokenizer.decode(ids) if req.echo else ""] * req.n]
        if req.stream:
            echoed = [not e for e in echo_of]

            def chunk(i: int, d: Delta, offset: int) -> dict:
                text = d.text if echoed[i] else echo_of[i] + d.text
                lp = self._completion_logprobs(d, len(echo_of[i]) + offset) if want_lp else None
                if lp is not None and not echoed[i]:
                    lp = {k: v + lp[k] for k, v in self._echo_logprobs(ids_of[i], gens[i]).items()}
                echoed[i] = True
                return base | {"choices": [{"index": i, "text": text, "finish_reason": None, "logprobs": lp}]}

            def final(i: int) -> list[dict]:
                return [base | {"choices": [{"index": i, "text": "", "logprobs": None,
                                             "finish_reason": gens[i].finish_reason}]}]
            return await self._stream(gens, chunk, final, base,
                                      bool(req.stream_options and req.stream_options.include_usage), req.n)
        lps = [{"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []} for _ in gens]

        def on_delta(i: int, d: Delta, offset: int) -> None:
            if want_lp:
                for k, v in self._completion_logprobs(d, len(echo_of[i]) + offset).items():
                    lps[i][k] += v
        texts = await self._collect(gens, on_delta)
        if req.echo and want_lp:
            lps = [{k: v + lp[k] for k, v in self._echo_logprobs(ids, g).items()}
                   for lp, g, ids in zip(lps, gens, ids_of)]
        return base | {"choices": [{"index": i, "text": echo_of[i] + t, "logprobs": lps[i] if want_lp else None,
                                    "finish_reason": g.finish_reason} for i, (t, g) in enumerate(zip(texts, gens))],
                       "usage": _usage(gens, req.n)}

    async def chat(self, req: ChatCompletionRequest):
        req.check_supported()
        self._check_model(req.model)
        specs = check_tools(req.tools, req.tool_choice)
        ids = self._chat_ids(req)
        params = req.sampling_params(req.max_new_tokens(), req.wanted_logprobs(), self.tokenizer.vocab_size)
        forced = forced_tool(req.tools, req.tool_choice, specs)
        if forced is not None and req.response_format and req.response_format.get("type") != "text":
            raise APIError(400, "response_format cannot be combined with a required tool call (tool_choice)",
                           param="response_format")
        params.structured = forced or structured_from_response_format(req.response_format)
        calls_possible = bool(specs) and req.tool_choice != "none"
        gens = await self._start_choices(ids, params, req.n, "chatcmpl")
        base = {"id": gens[0].request_id, "object": "chat.completion", "created": gens[0].created,
                "model": self.model_name}
        want_lp = req.logprobs

        def finish(i: int, text: str) -> tuple[dict, str]:
            """The message (or delta) and finish_reason of choice i, its whole text known."""
            calls = parse_tool_call(text, specs) if calls_possible else None
            if calls:
                return {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"
            return {"role": "assistant", "content": text}, gens[i].finish_reason
        if req.stream:
            sbase = base | {"object": "chat.completion.chunk"}
            started, held = [False] * len(gens), [""] * len(gens)

            def chunk(i: int, d: Delta, offset: int) -> dict | None:
                if calls_possible:  # a tool call is only known once the answer is complete
                    held[i] += d.text
                    return None
                delta = {"content": d.text} | ({} if started[i] else {"role": "assistant"})
                started[i] = True
                return sbase | {"choices": [{"index": i, "delta": delta, "finish_reason": None,
                                             "logprobs": self._chat_logprobs(d) if want_lp else None}]}

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
            return await self._stream(gens, chunk, final, sbase,
                                      bool(req.stream_options and req.stream_options.include_usage))
        content_lps: list[list] = [[] for _ in gens]

        def on_delta(i: int, d: Delta, offset: int) -> None:
            if want_lp:
                content_lps[i] += self._chat_logprobs(d)["content"]
        texts = await self._collect(gens, on_delta)
        choices = []
        for i, text in enumerate(texts):
            message, reason = finish(i, text)
            choices.append({"index": i, "message": message, "finish_reason": reason,
                            "logprobs": {"content": content_lps[i]} if want_lp else None})
        return base | {"choices": choices, "usage": _usage(gens)}
