"""`pdserve baseline-server`: Hugging Face transformers behind an OpenAI-compatible API, the
baseline of `pdserve bench-peers`.

It is the strongest simple server a user would write: one thread runs a batched forward loop
with transformers' own KV cache (DynamicCache). Waiting requests form a batch (up to
--max-batch), prompts are left-padded, and the batch decodes until its last request ends
(static batching: a request arriving meanwhile waits for the next batch). Same weights as
pdserve (the default model, dequantized to fp32), same tokenizer. Greedy or temperature
sampling; streaming with usage, like pdserve.
"""
from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


@dataclass
class Job:
    prompt: list[int]
    max_tokens: int
    temperature: float
    ignore_eos: bool
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: bool = False
    generated: int = 0

    def emit(self, token: int | None, finish: str | None = None) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, (token, finish))


class BatchLoop(threading.Thread):
    """Takes up to `max_batch` waiting jobs, generates them together to the end, repeats."""

    def __init__(self, model, eos: int | None, max_batch: int):
        super().__init__(daemon=True, name="baseline-batch-loop")
        self.model, self.eos, self.max_batch = model, eos, max_batch
        self.jobs: queue.Queue[Job | None] = queue.Queue()

    def run(self) -> None:
        while (job := self.jobs.get()) is not None:
            batch = [job]
            while len(batch) < self.max_batch:
                try:
                    nxt = self.jobs.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self.jobs.put(None)
                    break
                batch.append(nxt)
            batch = [j for j in batch if not j.cancelled]
            if batch:
                try:
                    self.generate(batch)
                except Exception as e:  # noqa: BLE001 -- every waiting client gets the error
                    for j in batch:
                        j.emit(None, f"error: {e}")

    @torch.inference_mode()
    def generate(self, batch: list[Job]) -> None:
        from transformers import DynamicCache

        B, L = len(batch), max(len(j.prompt) for j in batch)
        ids = torch.zeros(B, L, dtype=torch.long)
        mask = torch.zeros(B, L, dtype=torch.long)
        for i, j in enumerate(batch):  # left padding: every row's last prompt token is at L-1
            ids[i, L - len(j.prompt):] = torch.tensor(j.prompt)
            mask[i, L - len(j.prompt):] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                            use_cache=True).logits[:, -1]
        live = [True] * B
        while True:
            nxt = self.sample(logits, batch)
            for i, j in enumerate(batch):
                if not live[i]:
                    continue
                tok = int(nxt[i])
                j.generated += 1
                finish = "length" if j.generated >= j.max_tokens else (
                    "stop" if tok == self.eos and not j.ignore_eos else None)
                if j.cancelled:
                    finish = "cancelled"
                j.emit(tok, finish)
                live[i] = finish is None
            if not any(live):
                return
            mask = torch.cat([mask, torch.ones(B, 1, dtype=torch.long)], 1)
            pos = pos[:, -1:] + 1
            logits = self.model(input_ids=nxt[:, None], attention_mask=mask, position_ids=pos,
                                past_key_values=cache, use_cache=True).logits[:, -1]

    @staticmethod
    def sample(logits: torch.Tensor, batch: list[Job]) -> torch.Tensor:
        out = logits.argmax(-1)
        for i, j in enumerate(batch):
            if j.temperature > 1e-5:
                out[i] = torch.multinomial(torch.softmax(logits[i].float() / j.temperature, -1), 1)[0]
        return out


def build_app(loop_thread: BatchLoop, tokenizer, model_id: str):
    from pdserve.common.detokenizer import IncrementalDetokenizer

    app = FastAPI(title="transformers baseline")

    def error(message: str, param: str | None = None, status: int = 400):
        return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": param,
                                       "code": None}}, status_code=status)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_id, "object": "model", "owned_by": "transformers"}]}

    async def serve(req: Request, chat: bool):
        try:
            body = await req.json()
        except ValueError:
            return error("body is not valid JSON")
        if not isinstance(body, dict):
            return error("body must be a JSON object")
        if chat:
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs:
                return error("messages must be a non-empty list", "messages")
            prompt = tokenizer.encode(tokenizer.apply_chat_template(msgs))
        else:
            text = body.get("prompt")
            if not isinstance(text, str) or not text:
                return error("prompt must be a non-empty string", "prompt")
            prompt = tokenizer.encode(text)
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens", 16))
        if not isinstance(max_tokens, int) or max_tokens < 1:
            return error("max_tokens must be a positive integer", "max_tokens")
        temperature = body.get("temperature", 1.0)
        if not isinstance(temperature, (int, float)) or not 0 <= temperature <= 2:
            return error("temperature must be in [0, 2]", "temperature")
        job = Job(prompt, max_tokens, float(temperature), bool(body.get("ignore_eos", False)),
                  asyncio.get_running_loop())
        loop_thread.jobs.put(job)
        rid, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
        detok = IncrementalDetokenizer(tokenizer)

        def chunk(text: str, finish: str | None) -> dict:
            choice = {"index": 0, "finish_reason": finish}
            choice |= {"delta": {"content": text}} if chat else {"text": text}
            return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                    "created": created, "model": model_id, "choices": [choice]}

        async def tokens():
            try:
                while True:
                    tok, finish = await job.out.get()
                    if finish is not None and finish.startswith("error"):
                        raise RuntimeError(finish)
                    text = detok.push([tok]) + (detok.flush() if finish else "")
                    yield text, finish
                    if finish:
                        return
            finally:
                job.cancelled = True  # a client that went away stops costing rows

        usage = lambda: {"prompt_tokens": len(prompt), "completion_tokens": job.generated,
                         "total_tokens": len(prompt) + job.generated}
        if body.get("stream"):
            async def sse():
                async for text, finish in tokens():
                    yield f"data: {json.dumps(chunk(text, finish))}\n\n"
                if (body.get("stream_options") or {}).get("include_usage"):
                    yield f"data: {json.dumps(chunk('', None) | {'choices': [], 'usage': usage()})}\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(sse(), media_type="text/event-stream")
        parts, finish = [], None
        async for text, finish in tokens():
            parts.append(text)
        choice = {"index": 0, "finish_reason": finish}
        choice |= {"message": {"role": "assistant", "content": "".join(parts)}} if chat else {"text": "".join(parts)}
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": model_id, "choices": [choice], "usage": usage()}

    @app.post("/v1/completions")
    async def completions(req: Request):
        return await serve(req, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: Request):
        return await serve(req, chat=True)

    return app


def add_baseline_args(p) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--model", default="", help="GGUF file or Hugging Face directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--max-batch", type=int, default=32, help="most requests in one static batch")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    p.set_defaults(func=cmd_baseline_server)


def cmd_baseline_server(args) -> int:
    import uvicorn

    from pdserve.common.threads import in_fresh_thread, single_threaded_here
    from pdserve.common.tokenizer import Tokenizer
    from pdserve.common.model_files import served_model_name
    from pdserve.engine.model.weights import load_model

    from .engine import hf_baseline

    if args.threads:
        torch.set_num_threads(args.threads)
    def build():
        loaded = load_model(args.model or None, packed_weights=False)
        model = hf_baseline(loaded)
        loaded.model = None  # the transformers copy is the only one served
        return loaded, model

    # the same care as pdserve's workers (common/threads.py): the batch loop's OpenMP team is the
    # process's only one, or both run at half speed on a small machine
    loaded, model = in_fresh_thread(build)
    single_threaded_here()
    tokenizer = Tokenizer.from_model_path(loaded.path)
    worker = BatchLoop(model, tokenizer.eos_token_id, args.max_batch)
    worker.start()
    uvicorn.run(build_app(worker, tokenizer, served_model_name(loaded.path)), host=args.host, port=args.port,
                log_level="warning", timeout_graceful_shutdown=5)
    worker.jobs.put(None)
    return 0
