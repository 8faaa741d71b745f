"""The noisy-neighbour benchmark (`pdserve bench --workload noisy-neighbour`): what one
client's flood does to another client's interactive chats, in one run.

Tenant B is a person at a keyboard: short chats, one at a time, each reply read for `--think-s`
(0.3 s: B's own steps then take about a quarter of the machine). Tenant A floods at its maximum
rate: N streams at once, each sending its next request as soon as the last one ends; long
prompts, every third one with a JSON-schema `response_format` and every third one with n=2.
Each phase (a `Shape`) runs on prompts the server has not seen (no cache reuse) and ends by
cancelling A's streams (the server must drop what they asked for).

Without `--grid`, three phases: B `alone`; `flood` (no priority, no tenant: first come, first
served); `flood+priority` (B `priority: -1`, A 5, each with its tenant header). With `--grid`
(issue "Isolation, round two"): B alone, then B at `priority: -10` beside floods of 8, 24 and 48
streams, A at the default priority and at a worse one (5), with and without tenant headers;
"fair by default" (24 streams, no priority anywhere, each with its tenant header); and after each
flood size, A's flood of as many streams without B (A's throughput unharmed: its price), then B
alone again (a 2-core cloud VM's one-row step moves +-20% from minute to minute: each point is
judged against the mean of the B-alone phases just before and after it).

Reports B's TTFT and ITL p50/p99 per phase and their ratios to B alone; A's output tokens/s as
its client got them and the tokens the workers computed for it (prompts and decodes, from their
/metrics, less B's) while B was served, each as a share of A alone with as many streams; A's
refusals; in the grid, whether each phase meets its goal. A's ceiling: the share of A alone left
once B's own steps have run (the seconds the workers stepped for B alone, over B's time in the
phase), since B's steps take the machine's cores whatever the scheduler does.
"""
from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .metrics import RequestResult, cpu_description, percentile
from .client import first_model, resolve_tokenizer, send_one
from .workloads import Turn, Vocabulary
from .worker_counts import minus, worker_counts

SCHEMA = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                           "score": {"type": "integer", "minimum": 0, "maximum": 10}},
          "required": ["title", "score"]}


@dataclass(frozen=True)
class Shape:
    """One phase: A's `flood` streams (0: none) at `a_priority` (None: A sends none), B's chats
    at `b_priority` (None: none), each with its tenant header or not; `chats` False: A alone."""
    name: str
    flood: int = 0
    a_priority: int | None = None
    b_priority: int | None = None
    tenants: bool = False
    chats: bool = True

    @property
    def goal(self) -> tuple[float, float, float] | None:
        """B's (TTFT p50, ITL p50, ITL p99) bounds as ratios to alone: B more urgent, or fair by
        default (two tenants, no priority)."""
        if not self.flood or not self.chats:
            return None
        if self.b_priority is not None and (self.a_priority or 0) > self.b_priority:
            return 1.5, 1.3, 3.0
        if self.b_priority is None and self.a_priority is None and self.tenants:
            return 2.0, 1.5, None
        return None


ALONE = Shape("alone")
A_ONLY_WINDOW_S = 15.0


def phases(n: int) -> tuple[Shape, ...]:
    """The three phases of a plain run, A flooding with `n` streams."""
    return ALONE, Shape("flood", n), Shape("flood+priority", n, 5, -1, True)


def grid(floods=(8, 24, 48), urgent: int = -10) -> tuple[Shape, ...]:
    shapes = [ALONE]
    for n in floods:
        for a in (None, 5):
            for tenants in (False, True):
                shapes.append(Shape(f"{n} streams, A {'default' if a is None else a}, "
                                    f"{'tenants' if tenants else 'no tenant'}", n, a, urgent, tenants))
        if n == 24:
            shapes.append(Shape("24 streams, fair by default", 24, tenants=True))
        shapes.append(Shape(f"{n} streams, A only", n, tenants=True, chats=False))
        shapes.append(Shape(f"alone after {n} streams"))
    return tuple(shapes)


def _flood_sizes(text: str) -> tuple[int, ...]:
    """--grid-floods: comma-separated stream counts, each at least 1."""
    import argparse

    try:
        sizes = tuple(int(n) for n in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected stream counts such as 8,24,48")
    return sizes


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
    w.add_argument("--think-s", type=float, default=0.3,
                   help="noisy-neighbour: seconds B reads each reply before its next chat (default: %(default)s)")
    w.add_argument("--warmup", type=float, default=8.0,
                   help="noisy-neighbour: seconds A floods before B's first chat (default: %(default)s)")
    w.add_argument("--grid", action="store_true",
                   help="noisy-neighbour: every shape of issue 'Isolation, round two' in one run (floods of 8, 24, "
                        "48 streams; A at the default priority and at 5; with and without tenant headers; B at -10; "
                        "fair by default; A alone)")
    w.add_argument("--grid-floods", type=_flood_sizes, default=(8, 24, 48), metavar="N,N",
                   help="noisy-neighbour: the grid's flood sizes (default: 8,24,48)")


async def _flood(http, url: str, model: str, vocab: Vocabulary, rng: random.Random, tag: str,
                 priority: int | None, args, stats: dict) -> None:
    """A's stream: its next request as soon as the last one ends, until cancelled; the time of
    each token it receives goes into stats["tokens"] (A's throughput in any window)."""
    k = 0
    while True:
        k += 1
        prompt = f"{tag} {k}:" + vocab.text(rng, args.flood_input_len)
        body = {"model": model, "prompt": prompt, "max_tokens": 64, "temperature": 0.7, "stream": True,
                "ignore_eos": True}
        if priority is not None:
            body["priority"] = priority
        if k % 3 == 1:
            body |= {"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}},
                     "ignore_eos": False}
        elif k % 3 == 2:
            body["n"] = 2
        status = await _stream_tokens(http, url + "/v1/completions", body, stats["tokens"])
        stats[status] = stats.get(status, 0) + 1
        if status != "ok":
            await asyncio.sleep(0.2)  # a refusal: A retries, as a client would


async def _stream_tokens(http, url: str, body: dict, stamps: list[float]) -> str:
    """One streamed completion; the arrival time of each token (each choice's text piece) is
    appended to `stamps`. Its status: "ok", the HTTP status, or what broke."""
    import httpx

    try:
        async with http.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return str(resp.status_code)
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        return "stream_error"
                    stamps.extend(time.perf_counter() for c in chunk.get("choices") or [] if c.get("text"))
    except (httpx.HTTPError, OSError, ValueError) as e:  # counted; A goes on as a client would
        return type(e).__name__
    return "ok"


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
        await asyncio.sleep(args.think_s)  # the person reads the reply
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


async def _phase(url: str, model: str, vocab: Vocabulary, shape: Shape, n: int, args, auth: dict) -> dict:
    """One phase: A's flood in a process of its own (another client: its streams' parsing does
    not delay B's timestamps), B's chats here; A's tokens/s while B is served."""
    import multiprocessing

    rng = random.Random(args.seed * 1000 + n)
    tag = f"[{shape.name} {args.seed}]"  # every phase's prompts are new to the server
    headers_b = auth | ({"x-pdserve-tenant": "B"} if shape.tenants else {})
    headers_a = auth | ({"x-pdserve-tenant": "A"} if shape.tenants else {})
    flood, stop, results = None, None, None
    if shape.flood:
        ctx = multiprocessing.get_context("spawn")
        stop, results = ctx.Event(), ctx.Queue()
        flood = ctx.Process(target=_flood_process, daemon=True, args=(
            url, model, args.tokenizer, shape.flood, shape.a_priority, headers_a, args.flood_input_len,
            args.timeout, rng.random(), tag, stop, results))
        flood.start()
        assert await asyncio.get_running_loop().run_in_executor(None, results.get) == "flooding"
        await asyncio.sleep(args.warmup)
    counts = await worker_counts(url, auth)
    t_b = time.perf_counter()
    if shape.chats:
        async with httpx_client(args, headers_b) as http_b:
            b = await _chats(http_b, url, model, vocab, rng, tag, shape.b_priority, args)
    else:  # A alone, for a window as long as B's chats take beside A
        await asyncio.sleep(A_ONLY_WINDOW_S)
        b = []
    t_end = time.perf_counter()
    counts = minus(await worker_counts(url, auth), counts)
    stats: dict = {"tokens": []}
    if flood is not None:
        stop.set()  # A goes away: what it asked for must stop on the server
        stats = await asyncio.get_running_loop().run_in_executor(None, results.get)
        flood.join(30)
    out = {"B": _summary(b) if shape.chats else None, "B_seconds": round(t_end - t_b, 1),
           "A": _a_rates(stats, t_b, t_end) if shape.flood else None}
    if shape.flood and counts is not None:  # the workers' own count, less B's tokens
        b_tokens = sum((r.prompt_tokens or r.input_len) + r.output_tokens for r in b)
        out["A"]["computed_tokens_per_s"] = round((counts["tokens"] - b_tokens) / max(t_end - t_b, 1e-9), 1)
    elif counts is not None:  # B alone: the seconds its steps took (the machine was B's then)
        out["B_busy_s"] = round(counts["step_s"], 2)
    if counts is not None:
        out["workers"] = counts["roles"]
    if flood is not None:
        await asyncio.sleep(min(2.0, args.warmup))  # the server drops A's cancelled requests before the next phase
    return out


def _a_rates(stats: dict, t_b: float, t_end: float) -> dict:
    """A's output tokens per second from `t_b` to `t_end`, as its client received them (A's
    requests take ~30 s at 24 streams and end in waves: in a 6-15 s window this moves +-40%
    from run to run; the workers' computed tokens, `_phase`, are the steadier price)."""
    out_tokens = sum(t_b <= t <= t_end for t in stats["tokens"])
    return {"output_tokens_per_s": round(out_tokens / max(t_end - t_b, 1e-9), 1),
            "requests": {k: v for k, v in stats.items() if k != "tokens"}}


def _flood_process(url, model, tokenizer, streams, priority, headers, input_len, timeout, seed, tag, stop,
                   results) -> None:
    """Client A, in a process of its own: `streams` flooding streams until `stop` is set; puts
    "flooding" once they are sent, then its stats (the time of every token it received)."""
    asyncio.run(_flood_main(url, model, tokenizer, streams, priority, headers, input_len, timeout, seed, tag, stop,
                            results))


async def _flood_main(url, model, tokenizer, streams, priority, headers, input_len, timeout, seed, tag, stop,
                      results) -> None:
    from types import SimpleNamespace

    import httpx

    vocab = Vocabulary(resolve_tokenizer(tokenizer, model)[0])
    rng, stats = random.Random(seed), {"tokens": []}
    args = SimpleNamespace(flood_input_len=input_len)
    async with httpx.AsyncClient(timeout=timeout, headers=headers,
                                 limits=httpx.Limits(max_connections=2 * streams + 8)) as http:
        tasks = [asyncio.ensure_future(_flood(http, url, model, vocab, random.Random(rng.random()), f"{tag} A{j}",
                                              priority, args, stats)) for j in range(streams)]
        results.put("flooding")
        while not stop.is_set():
            await asyncio.sleep(0.05)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    results.put(stats)


def httpx_client(args, headers: dict, connections: int = 8):
    import httpx

    return httpx.AsyncClient(timeout=args.timeout, headers=headers, limits=httpx.Limits(max_connections=connections))


async def run(args) -> dict:
    url = args.base_url.rstrip("/")
    auth = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    out: dict = {"url": url, "cpu": cpu_description(), "b_think_s": args.think_s, "phases": {}}
    async with httpx_client(args, auth) as probe:
        model = args.model or await first_model(probe, url)
    tokenizer, _ = resolve_tokenizer(args.tokenizer, model)
    vocab = Vocabulary(tokenizer)
    shapes = grid(getattr(args, "grid_floods", (8, 24, 48))) if getattr(args, "grid", False) else phases(args.flood_concurrency)
    for n, shape in enumerate(shapes):
        out["phases"][shape.name] = phase = await _phase(url, model, vocab, shape, n, args, auth)
        phase["shape"] = {"flood": shape.flood, "a_priority": shape.a_priority, "b_priority": shape.b_priority,
                          "tenants": shape.tenants}
        print(f"{shape.name}: B {phase['B']} A {phase['A']}", file=sys.stderr)
    _judge(out["phases"], shapes)
    return out


B_KEYS = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")


def _alone_around(phases: dict, shapes, i: int) -> tuple[dict, float | None]:
    """B alone as the phase `shapes[i]` is judged against: the mean of the B-alone phases just
    before and just after it (the grid runs one after each flood size, so a machine whose speed
    drifts over the run moves both sides of a ratio alike); (B's figures, B's busy seconds)."""
    alone = [j for j, s in enumerate(shapes) if not s.flood and s.chats]
    around = [phases[shapes[j].name] for j in ([j for j in alone if j < i][-1:] + [j for j in alone if j > i][:1])]
    b = {k: (round(sum(a["B"][k] for a in around) / len(around), 2) if all(a["B"][k] for a in around) else None)
         for k in B_KEYS}
    busy = [a["B_busy_s"] for a in around if a.get("B_busy_s") is not None]
    return b, (sum(busy) / len(busy) if busy else None)


def _judge(phases: dict, shapes) -> None:
    """Each phase's ratios to B alone (`_alone_around`) and, where the shape has a goal, whether
    it is met; A's throughput beside B against A alone (the price), where the run has A alone."""
    a_only = {s.flood: phases[s.name]["A"] for s in shapes if s.flood and not s.chats}
    for i, shape in enumerate(shapes):
        p = phases[shape.name]
        if not shape.flood or not shape.chats:
            continue
        b, (alone, busy) = p["B"], _alone_around(phases, shapes, i)
        p["alone_ms"] = alone
        p["ratio_to_alone"] = {k: round(b[k] / alone[k], 2) if b[k] and alone[k] else None for k in B_KEYS}
        if busy is not None:  # B's own steps need the machine that long whatever the scheduler does
            p["A"]["ceiling_of_alone"] = round(max(1.0 - busy / max(p["B_seconds"], 1e-9), 0.0), 2)
        if shape.flood in a_only:  # A alone with as many streams
            base = a_only[shape.flood]
            p["A"]["share_of_alone"] = round(p["A"]["output_tokens_per_s"] / max(base["output_tokens_per_s"], 1e-9), 2)
            if "computed_tokens_per_s" in p["A"] and "computed_tokens_per_s" in base:
                p["A"]["computed_share_of_alone"] = round(
                    p["A"]["computed_tokens_per_s"] / max(base["computed_tokens_per_s"], 1e-9), 2)
        if shape.goal:
            r = p["ratio_to_alone"]
            p["goal_met"] = all(bound is None or (r[k] is not None and r[k] <= bound) for k, bound in
                                zip(("ttft_p50_ms", "itl_p50_ms", "itl_p99_ms"), shape.goal))


def format_noisy(res: dict) -> str:
    rows = ["| phase | B TTFT p50 / p99 (ms) | B ITL p50 / p99 (ms) | B vs alone: TTFT p50, ITL p50, ITL p99 | "
            "A out tok/s (of A alone) | A computed tok/s (of A alone; at most, by B's steps alone) | A refused | goal |", "|---|---|---|---|---|---|---|---|"]
    for phase, p in res["phases"].items():
        b, ratio, a = p["B"] or {}, p.get("ratio_to_alone") or {}, p["A"] or {}
        refused = sum(v for k, v in (a.get("requests") or {}).items() if k not in ("ok", "CancelledError"))
        share = f" ({a['share_of_alone']}x)" if "share_of_alone" in a else ""
        computed = f" ({a['computed_share_of_alone']}x" if "computed_share_of_alone" in a else ""
        computed += f"; at most {a['ceiling_of_alone']}x)" if "ceiling_of_alone" in a else ")" if computed else ""
        goal = {True: "met", False: "**missed**"}.get(p.get("goal_met"), "-")
        rows.append(f"| {phase} | {b.get('ttft_p50_ms', '-')} / {b.get('ttft_p99_ms', '-')} | "
                    f"{b.get('itl_p50_ms', '-')} / {b.get('itl_p99_ms', '-')} | "
                    f"{ratio.get('ttft_p50_ms', '-')}x, {ratio.get('itl_p50_ms', '-')}x, {ratio.get('itl_p99_ms', '-')}x | "
                    f"{a.get('output_tokens_per_s', '-')}{share} | {a.get('computed_tokens_per_s', '-')}{computed} | "
                    f"{refused if a else '-'} | {goal} |")
    return "\n".join(rows)


def cmd_noisy(args) -> int:
    res = asyncio.run(run(args))
    path = Path(args.output)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=2) + "\n")
    print(format_noisy(res))
    print(f"wrote {path}", file=sys.stderr)
    return 0
