"""The noisy-neighbour benchmark (`pdserve bench --workload noisy-neighbour`): what one
client's flood does to another client's interactive chats, in one run.

Tenant B is a person at a keyboard: short chats, one at a time. Tenant A floods at its maximum
rate: `--flood-concurrency` streams at once, each sending its next request as soon as the last
one ends; long prompts, every third one with a JSON-schema `response_format` and every third
one with n=2. Three phases, each on prompts the server has not seen (no cache reuse):

- `alone`: B by itself;
- `flood`: B beside A, every request equal (no priority, no tenant: first come, first served);
- `flood+priority`: B beside A, B `priority: -1` and A `priority: 5` (lower is served sooner),
  each with its tenant header (x-pdserve-tenant), so the queues share fairly between them.

Reports B's TTFT and ITL p50/p99 per phase and their ratio to `alone`, and A's output tokens/s
and refusals. Goal (issue "Isolation"): B's TTFT p50 within 1.5x and ITL p50 within 1.3x of
alone while A floods.
"""
from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from pathlib import Path

from .metrics import RequestResult, cpu_description, percentile
from .client import first_model, resolve_tokenizer, send_one
from .workloads import Turn, Vocabulary

SCHEMA = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                           "score": {"type": "integer", "minimum": 0, "maximum": 10}},
          "required": ["title", "score"]}
PHASES = (("alone", None), ("flood", (0, "")), ("flood+priority", (5, "A")))


def add_noisy_args(w) -> None:
    """The workload's flags (the `workload` group of `pdserve bench`)."""
    w.add_argument("--flood-concurrency", type=int, default=8,
                   help="noisy-neighbour: tenant A's streams at once (default: %(default)s)")
    w.add_argument("--flood-input-len", type=int, default=1000,
                   help="noisy-neighbour: tenant A's prompt tokens (default: %(default)s)")
    w.add_argument("--chats", type=int, default=12, help="noisy-neighbour: tenant B's chats per phase (default: %(default)s)")
    w.add_argument("--chat-input-len", type=int, default=48, help="noisy-neighbour: B's prompt tokens (default: %(default)s)")
    w.add_argument("--chat-output-len", type=int, default=32,
                   help="noisy-neighbour: B's output tokens (default: %(default)s)")
    w.add_argument("--warmup", type=float, default=8.0,
                   help="noisy-neighbour: seconds A floods before B's first chat (default: %(default)s)")


async def _flood(http, url: str, model: str, vocab: Vocabulary, rng: random.Random, tag: str, priority: int,
                 args, stop: asyncio.Event, stats: dict) -> None:
    k = 0
    while not stop.is_set():
        k += 1
        prompt = f"{tag} {k}:" + vocab.text(rng, args.flood_input_len)
        body = {"model": model, "prompt": prompt, "max_tokens": 64, "temperature": 0.7, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": True, "priority": priority}
        if k % 3 == 1:
            body |= {"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}},
                     "ignore_eos": False}
        elif k % 3 == 2:
            body["n"] = 2
        r, _ = await send_one(http, url, "/v1/completions", body, Turn(prompt, args.flood_input_len, 64), 0.0)
        stats["tokens"] += r.output_tokens
        stats[r.status] = stats.get(r.status, 0) + 1
        if not r.ok:
            await asyncio.sleep(0.2)  # a refusal: A retries, as a client would


async def _chats(http, url: str, model: str, vocab: Vocabulary, rng: random.Random, tag: str, priority: int | None,
                 args) -> list[RequestResult]:
    out = []
    for i in range(args.chats):
        prompt = f"{tag} chat {i}:" + vocab.text(rng, args.chat_input_len)
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": args.chat_output_len,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
        if priority is not None:
            body["priority"] = priority
        r, _ = await send_one(http, url, "/v1/chat/completions", body,
                              Turn(prompt, args.chat_input_len, args.chat_output_len), 0.0)
        out.append(r)
        await asyncio.sleep(0.3)  # the person reads the reply
    return out


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 1)


def _summary(results: list[RequestResult]) -> dict:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok]
    itl = [g for r in ok for g in r.itl]
    return {"ok": len(ok), "failed": len(results) - len(ok), "ttft_p50_ms": _ms(percentile(ttft, 50)),
            "ttft_p99_ms": _ms(percentile(ttft, 99)), "itl_p50_ms": _ms(percentile(itl, 50)),
            "itl_p99_ms": _ms(percentile(itl, 99))}


async def run(args) -> dict:
    import httpx

    url = args.base_url.rstrip("/")
    auth = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    out: dict = {"url": url, "cpu": cpu_description(), "phases": {}}
    async with httpx.AsyncClient(timeout=args.timeout, headers=auth) as probe:
        model = args.model or await first_model(probe, url)
    tokenizer, _ = resolve_tokenizer(args.tokenizer, model)
    vocab = Vocabulary(tokenizer)
    for n, (phase, flood) in enumerate(PHASES):
        rng = random.Random(args.seed * 1000 + n)
        tag = f"[{phase} {args.seed}]"  # every phase's prompts are new to the server
        headers_b = auth | ({"x-pdserve-tenant": "B"} if flood and flood[1] else {})
        headers_a = auth | ({"x-pdserve-tenant": flood[1]} if flood and flood[1] else {})
        stop, stats = asyncio.Event(), {"tokens": 0}
        async with httpx.AsyncClient(timeout=args.timeout, headers=headers_a,
                                     limits=httpx.Limits(max_connections=64)) as http_a, \
                httpx.AsyncClient(timeout=args.timeout, headers=headers_b) as http_b:
            flooders = [asyncio.ensure_future(_flood(http_a, url, model, vocab, random.Random(rng.random()),
                                                     f"{tag} A{j}", flood[0], args, stop, stats))
                        for j in range(args.flood_concurrency)] if flood else []
            t0 = time.perf_counter()
            if flooders:
                await asyncio.sleep(args.warmup)
            t_b = time.perf_counter()
            b = await _chats(http_b, url, model, vocab, rng, tag, -1 if flood and flood[1] else None, args)
            stop.set()
            span = time.perf_counter() - t_b
            await asyncio.gather(*flooders, return_exceptions=True)
        out["phases"][phase] = {"B": _summary(b), "A": {"output_tokens_per_s": round(stats["tokens"] / max(
            time.perf_counter() - t0, 1e-9), 1), "requests": {k: v for k, v in stats.items() if k != "tokens"}}
                                if flood else None, "B_seconds": round(span, 1)}
        print(f"{phase}: B {out['phases'][phase]['B']}", file=sys.stderr)
    alone = out["phases"]["alone"]["B"]
    for phase, _ in PHASES[1:]:
        b = out["phases"][phase]["B"]
        out["phases"][phase]["ratio_to_alone"] = {
            k: round(b[k] / alone[k], 2) if b[k] and alone[k] else None
            for k in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")}
    return out


def format_noisy(res: dict) -> str:
    rows = ["| phase | B TTFT p50 / p99 (ms) | B ITL p50 / p99 (ms) | B TTFT p50, ITL p50 vs alone | A out tok/s | A refused |",
            "|---|---|---|---|---|---|"]
    for phase, p in res["phases"].items():
        b, ratio = p["B"], p.get("ratio_to_alone") or {}
        a = p["A"] or {}
        refused = sum(v for k, v in (a.get("requests") or {}).items() if k != "ok")
        rows.append(f"| {phase} | {b['ttft_p50_ms']} / {b['ttft_p99_ms']} | {b['itl_p50_ms']} / {b['itl_p99_ms']} | "
                    f"{ratio.get('ttft_p50_ms', '-')}x, {ratio.get('itl_p50_ms', '-')}x | "
                    f"{a.get('output_tokens_per_s', '-')} | {refused if a else '-'} |")
    return "\n".join(rows)


def cmd_noisy(args) -> int:
    res = asyncio.run(run(args))
    path = Path(args.output)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=2) + "\n")
    print(format_noisy(res))
    print(f"wrote {path}", file=sys.stderr)
    return 0
