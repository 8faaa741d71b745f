"""OpenAI response shapes: usage, logprobs in the completions and chat formats, and a set of
choices streamed as server-sent events (whatever fails after the first event ends the stream
with an error event and `[DONE]`)."""
from __future__ import annotations

import asyncio
import json
from typing import Callable

from fastapi.responses import StreamingResponse

from pdserve.common.aio import detached, stop_tasks
from pdserve.common.tokenizer import Tokenizer

from .errors import api_error_of
from .generation import Delta, Generation


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def usage(gens: list[Generation], per_prompt: int | None = None) -> dict:
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


class Logprobs:
    """Token logprobs as the API shows them: each token as its text."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _offsets(self, toks: list[str], start: int) -> list[int]:
        offsets, pos = [], start
        for t in toks:
            offsets.append(pos)
            pos += len(t)
        return offsets

    def completion(self, d: Delta, offset: int) -> dict:
        """A delta's tokens in the completions format; `offset`: where its text starts."""
        toks = [self._text(lp.token_id) for lp in d.logprobs]
        return {"tokens": toks, "token_logprobs": [lp.logprob for lp in d.logprobs],
                "top_logprobs": [{self._text(t): v for t, v in lp.top} for lp in d.logprobs],
                "text_offset": self._offsets(toks, offset)}

    def echo(self, ids: list[int], g: Generation) -> dict:
        """The prompt's tokens with their logprobs (the first token has none), for echo."""
        toks = [self._text(t) for t in ids]
        return {"tokens": toks, "token_logprobs": [None] + [lp.logprob for lp in g.prompt_logprobs],
                "top_logprobs": [None] + [{self._text(t): v for t, v in lp.top} for lp in g.prompt_logprobs],
                "text_offset": self._offsets(toks, 0)}

    def chat(self, d: Delta) -> dict:
        """A delta's tokens in the chat format: `bytes` are the token's own, also for a token
        that holds part of a character (its `token` text shows U+FFFD for that part)."""
        def entry(t, v):
            return {"token": self._text(t), "logprob": v, "bytes": list(self.tokenizer.token_bytes(t))}
        return {"content": [entry(lp.token_id, lp.logprob) | {"top_logprobs": [entry(t, v) for t, v in lp.top]}
                            for lp in d.logprobs]}


async def collect(gens: list[Generation], on_delta: Callable[[int, Delta, int], None]) -> list[str]:
    """Every choice's whole text; `on_delta(i, delta, offset)` sees each delta as it comes.
    The choices are closed however this ends."""
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


STREAM_BUFFER = 64  # deltas held per choice for a client that reads slower than they come


class ReaderStalled(Exception):
    """The client stopped reading its stream for longer than the stall timeout."""


def timing(gens: list[Generation]) -> list[dict]:
    """Where each choice's time went (the `timing` of a response, when asked for)."""
    return [{"index": i} | g.timing() for i, g in enumerate(gens)]


async def stream(gens: list[Generation], chunk, final, base: dict, include_usage: bool,
                 per_prompt: int | None = None, stall_timeout_s: float = 60.0, on_stall=None,
                 include_timing: bool = False, encode: Callable[[object], str] = sse,
                 done: str = "data: [DONE]\n\n") -> StreamingResponse:
    """SSE of every choice's deltas as they come; `chunk(i, delta, offset)` and `final(i)`
    give the events (or None to send nothing), `encode` writes each (and the error body of a
    stream that fails) as SSE text, `done` ends the stream ("": nothing). The usage and the
    timing, when asked for, come in one last chunk with no choices. Deltas wait for a slow
    reader in a buffer of STREAM_BUFFER per choice (then the worker's stream waits, by gRPC's
    flow control); a reader that takes none for `stall_timeout_s` (0: no limit) has its
    requests aborted on the workers, and `on_stall()` is called."""
    async def events():
        q: asyncio.Queue = asyncio.Queue(maxsize=STREAM_BUFFER * len(gens))

        async def put(item) -> None:
            if not q.full():  # room: no wait, so no stall to time (a timer per delta cost ~6 us of its ~190)
                q.put_nowait(item)
                return
            try:
                # asyncio.timeout, not wait_for: on 3.11 wait_for drops a cancel that lands as
                # the put completes, and the pump would go on for a client that hung up
                async with asyncio.timeout(stall_timeout_s or None):
                    await q.put(item)
            except TimeoutError:
                if on_stall is not None:
                    on_stall()
                await asyncio.gather(*(g.close() for g in gens), return_exceptions=True)
                raise ReaderStalled(f"the client read nothing for {stall_timeout_s:g} s") from None

        async def pump(i: int, g: Generation):
            try:
                async for d in g.deltas():
                    await put((i, d))
                await put((i, None))
            except ReaderStalled:
                return  # nobody reads: nothing more to queue
            except BaseException as e:  # noqa: BLE001 - reported in-band below
                await put((i, e))
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
                        yield encode(ev)
                    continue
                ev = chunk(i, item, offsets[i])
                offsets[i] += len(item.text)
                if ev is not None:
                    yield encode(ev)
            if include_usage or include_timing:
                yield encode(base | {"choices": []} | ({"usage": usage(gens, per_prompt)} if include_usage else {})
                             | ({"timing": timing(gens)} if include_timing else {}))
        except Exception as e:  # noqa: BLE001 - after the first byte the status is sent: report in-band
            yield encode(api_error_of(e).body())
        finally:
            await detached(_end(tasks, gens))
        if done:
            yield done

    # Start the generator now: a started async generator is closed (its `finally` runs,
    # aborting the requests) whenever it is dropped, even if the client vanished before
    # the server began to send the body and the body was never iterated.
    inner = events()
    first = await anext(inner)

    async def body():
        try:
            yield first
            async for item in inner:
                yield item
        finally:
            await inner.aclose()

    return ClosingStreamingResponse(body(), media_type="text/event-stream",
                                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _end(tasks: list[asyncio.Task], gens: list[Generation]) -> None:
    await stop_tasks(*tasks)
    await asyncio.gather(*(g.close() for g in gens), return_exceptions=True)


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that closes its body however it ends. Starlette leaves the body
    suspended at a `yield` when the client hangs up while a chunk is being sent; closing it
    here aborts its requests now rather than whenever the generator is garbage collected."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await detached(self.body_iterator.aclose())
