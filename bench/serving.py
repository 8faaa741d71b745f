"""`pdserve bench`: a serving benchmark against any OpenAI-compatible endpoint.

Flow: build a seeded workload (bench/workloads.py) -> for each endpoint and each load
point of the sweep (request rate × concurrency) send it with streaming requests on an
httpx.AsyncClient, one record per request -> metrics (bench/metrics.py) -> a table on
stdout, JSON results and, when matplotlib is importable, PNG plots. Every endpoint gets the
same prompts; load point i uses seed + i so one point's prompts are not cache hits for the
next. A load point stops sending new requests after --max-duration and waits for those in
flight (dropping slow requests would flatter the tail).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from .metrics import (
    RequestResult,
    format_breakdown,
    format_table,
    load_label,
    parse_prefix_cache,
    prefix_cache_delta,
    summarize,
    table_row,
)
from .client import first_model, resolve_tokenizer, send_one
from .noisy import add_noisy_args
from .workloads import (
    Session,
    Turn,
    Vocabulary,
    arrival_offsets,
    load_trace,
    agentic_workload,
    multi_turn_workload,
    parse_range,
    random_workload,
    shared_prefix_workload,
    trace_offsets,
    trace_workload,
    workload_summary,
)

TIMING_HEADER = "X-PDServe-Timing"  # router/app.py: asks pdserve for each choice's time breakdown

METRICS_SETTLE_S = 1.0  # pdserve's router refreshes worker counters every 0.25-0.5 s: wait for the last ones


def add_bench_serving_args(p) -> None:
    e = p.add_argument_group("endpoint")
    e.add_argument("--base-url", default="http://127.0.0.1:8000", help="OpenAI-compatible server (default: %(default)s)")
    e.add_argument("--endpoints", default="", help="compare servers: name=url,name2=url2 (each gets the same workload)")
    e.add_argument("--model", default="", help="model id (default: the first one of GET /v1/models)")
    e.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", ""), help="Bearer key (env OPENAI_API_KEY)")
    e.add_argument("--api", choices=("completions", "chat"), default="completions",
                   help="API of single-turn workloads (multi-turn always uses chat)")
    e.add_argument("--tokenizer", default="auto", help="lengths in tokens of: auto (pdserve's default model's "
                   "tokenizer when the model id names SmolLM2, else words), words, or a GGUF/HF tokenizer path")
    e.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default: %(default)s)")
    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=("random", "shared-prefix", "multi-turn", "agentic", "trace",
                                          "noisy-neighbour"),
                   default="random", help="noisy-neighbour: one tenant floods beside another's chats (bench/noisy.py)")
    w.add_argument("--num-requests", type=int, default=None, help="requests per load point (default: random 100; "
                   "the others their natural size: groups × prompts, conversations × turns, the trace)")
    w.add_argument("--seed", type=int, default=0, help="prompts, lengths and arrivals (default: %(default)s)")
    w.add_argument("--input-len", default="512", help="prompt tokens, N or MIN:MAX (random; multi-turn: per user turn) (default: %(default)s)")
    w.add_argument("--output-len", default="128", help="output tokens, N or MIN:MAX (all but trace) (default: %(default)s)")
    w.add_argument("--num-groups", type=int, default=8, help="shared-prefix: groups sharing a system prompt (default: %(default)s)")
    w.add_argument("--prompts-per-group", type=int, default=8, help="shared-prefix: prompts per group (default: %(default)s)")
    w.add_argument("--system-prompt-len", type=int, default=1024, help="shared-prefix and multi-turn: system prompt tokens (default: %(default)s)")
    w.add_argument("--question-len", type=int, default=64, help="shared-prefix: question tokens after the system prompt (default: %(default)s)")
    w.add_argument("--num-conversations", type=int, default=8, help="multi-turn: conversations (default: %(default)s)")
    w.add_argument("--num-turns", type=int, default=4, help="multi-turn: user turns per conversation (default: %(default)s)")
    w.add_argument("--think-time", type=float, default=1.0,
                   help="agentic: seconds between a reply and the next tool result (default: %(default)s)")
    w.add_argument("--trace", default="", help="trace: JSONL with timestamp (s), input_len, output_len[, prompt, hash_ids]")
    w.add_argument("--trace-block-size", type=int, default=512, help="trace: tokens per hash_ids entry (default: %(default)s)")
    add_noisy_args(w)
    ld = p.add_argument_group("load")
    ld.add_argument("--request-rate", type=float, default=None,
                    help="arrivals per second (default: inf, all at once; trace: its own timestamps)")
    ld.add_argument("--request-rates", default="", help="a sweep in one run, e.g. 0.5,1,2,inf")
    ld.add_argument("--burstiness", type=float, default=1.0,
                    help="shape of the gamma-distributed gaps: 1 Poisson, <1 burstier, >1 more regular (default: %(default)s)")
    ld.add_argument("--max-concurrency", default="", help="most requests in flight (a list sweeps: 1,4,16)")
    ld.add_argument("--max-duration", type=float, default=None, help="seconds per load point before sending stops")
    ld.add_argument("--temperature", type=float, default=0.0)
    ld.add_argument("--no-ignore-eos", action="store_true",
                    help="do not send ignore_eos (servers that refuse it; output lengths are then up to the model)")
    ld.add_argument("--extra-body", default="", help="JSON object merged into every request body")
    o = p.add_argument_group("SLO and output")
    o.add_argument("--slo-ttft", type=float, default=2.0, help="goodput: TTFT at most this many seconds (default: %(default)s)")
    o.add_argument("--slo-tpot", type=float, default=0.1, help="goodput: TPOT at most this many seconds (default: %(default)s)")
    o.add_argument("--output", default="bench/serving-results.json", help="JSON results (default: %(default)s)")
    o.add_argument("--plot-dir", default="", help="write PNG plots here (needs matplotlib)")
    o.add_argument("--save-requests", action="store_true", help="keep every request's record in the JSON")
    p.set_defaults(func=cmd_bench_serving)


# ---- settings -> plan ----------------------------------------------------------------------
def parse_endpoints(spec: str, base_url: str) -> list[tuple[str, str]]:
    """'a=http://h:1,b=http://h:2' -> [(name, url)]; without a spec, the base URL named by its host."""
    pairs = [item.split("=", 1) for item in spec.split(",") if item.strip()] if spec else []
    if any(len(p) != 2 or not p[0].strip() for p in pairs):
        raise ValueError(f"--endpoints {spec!r}: expected name=url,name2=url2")
    if not pairs:
        pairs = [(base_url.split("://")[-1].split("/")[0], base_url)]
    urls = [(n.strip(), u.strip().rstrip("/").removesuffix("/v1")) for n, u in pairs]
    if len({n for n, _ in urls}) != len(urls):
        raise ValueError("--endpoints: names must differ")
    return urls


def load_points(rates: str, rate: float | None, concurrency: str, trace: bool) -> list[tuple[float | None, int | None]]:
    """(request rate, max concurrency) of each run: the rate sweep × the concurrency sweep.
    A rate of None replays a trace's own timestamps."""
    rs = [float(r) for r in rates.split(",") if r.strip()] if rates else [rate]
    rs = [(None if trace else math.inf) if r is None else r for r in rs]
    if any(r is not None and r <= 0 for r in rs):
        raise ValueError("request rates must be > 0")
    cs = [int(c) for c in concurrency.split(",") if c.strip()] if concurrency else [None]
    if any(c is not None and c <= 0 for c in cs):
        raise ValueError("--max-concurrency must be > 0")
    return [(r, c) for r in rs for c in cs]


def build_workload(args, vocab: Vocabulary, seed: int, trace_records: list[dict] | None = None) -> list[Session]:
    """The sessions of one load point (`--num-requests` caps the request count)."""
    out_len = parse_range(args.output_len)
    if args.workload == "random":
        s = random_workload(vocab, args.num_requests or 100, parse_range(args.input_len), out_len, seed, args.api)
    elif args.workload == "shared-prefix":
        s = shared_prefix_workload(vocab, args.num_groups, args.prompts_per_group, args.system_prompt_len,
                                   args.question_len, out_len, seed, args.api)
    elif args.workload == "multi-turn":
        n = args.num_conversations
        if args.num_requests:  # enough conversations for the requests asked for
            n = math.ceil(args.num_requests / args.num_turns)
        s = multi_turn_workload(vocab, n, args.num_turns, parse_range(args.input_len), out_len,
                                args.system_prompt_len, seed)
    elif args.workload == "agentic":  # --num-conversations sessions; --input-len: each tool result
        s = agentic_workload(vocab, args.num_conversations, args.num_turns, args.system_prompt_len,
                             parse_range(args.input_len), out_len, args.think_time, seed)
    else:
        s = trace_workload(vocab, trace_records or [], seed, args.trace_block_size, args.api)
    return cap_requests(s, args.num_requests)


def cap_requests(sessions: list[Session], n: int | None) -> list[Session]:
    """The first sessions holding `n` requests (the last one cut short if needed)."""
    if not n:
        return sessions
    out, left = [], n
    for s in sessions:
        if left <= 0:
            break
        out.append(s if len(s.turns) <= left else replace(s, turns=s.turns[:left]))
        left -= len(out[-1].turns)
    return out


def request_body(model: str, session: Session, turn: Turn, history: list[dict], temperature: float,
                 ignore_eos: bool, extra: dict) -> tuple[str, dict]:
    """(path, JSON body) of one streaming request; max_tokens is the output length asked for."""
    body = {"model": model, "max_tokens": turn.output_len, "temperature": temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    if session.api == "chat":
        body["messages"] = history + [{"role": "user", "content": turn.prompt}]
        return "/v1/chat/completions", body | extra
    body["prompt"] = turn.prompt
    return "/v1/completions", body | extra


class Progress:
    """One live line on stderr (carriage returns on a terminal, a line every 10 s otherwise)."""

    def __init__(self, label: str, total: int, stream=sys.stderr):
        self.label, self.total, self.stream = label, total, stream
        self.tty = hasattr(stream, "isatty") and stream.isatty()
        self.sent = self.done = self.failed = 0
        self.t0 = self._last = time.perf_counter()

    def update(self, sent: int = 0, result: RequestResult | None = None) -> None:
        self.sent += sent
        if result is not None:
            self.done += 1
            self.failed += not result.ok
        now = time.perf_counter()
        if now - self._last >= (0.1 if self.tty else 10.0):
            self._last = now
            self._write()

    def _write(self, end: str = "") -> None:
        line = (f"{self.label}: {self.done}/{self.total} done, {self.sent - self.done} in flight, "
                f"{self.failed} failed, {time.perf_counter() - self.t0:.1f}s")
        self.stream.write(("\r" + line + "\033[K" + end) if self.tty else line + "\n")
        self.stream.flush()

    def close(self) -> None:
        self._write("\n")


async def run_load_point(client, url: str, model: str, sessions: list[Session], offsets: list[float],
                         concurrency: int | None, max_duration: float | None, opts: dict,
                         progress: Progress) -> tuple[list[RequestResult], float, int]:
    """Send `sessions` starting at `offsets` (s) -> (records, duration, requests not sent)."""
    t0 = time.perf_counter()
    deadline = t0 + max_duration if max_duration else math.inf
    sem = asyncio.Semaphore(concurrency) if concurrency else None
    results: list[RequestResult] = []
    not_sent = 0

    async def session(s: Session, offset: float) -> None:
        nonlocal not_sent
        if t0 + offset >= deadline:  # arrives after the end: not worth waiting for
            not_sent += len(s.turns)
            return
        await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
        history = [{"role": "system", "content": s.system}] if s.api == "chat" and s.system else []
        for k, turn in enumerate(s.turns):
            async with sem or contextlib.nullcontext():
                if time.perf_counter() >= deadline:
                    not_sent += len(s.turns) - k
                    return
                path, body = request_body(model, s, turn, history, **opts)
                progress.update(sent=1)
                r, reply = await send_one(client, url, path, body, turn, t0)
            results.append(r)
            progress.update(result=r)
            if not r.ok:  # the conversation cannot go on: its later turns are misses too
                results.extend(RequestResult("session_aborted", r.sent + r.e2e, t.input_len, t.output_len, e2e=0.0)
                               for t in s.turns[k + 1:])
                return
            history += [{"role": "user", "content": turn.prompt}, {"role": "assistant", "content": reply}]
            if s.think_s and k + 1 < len(s.turns):  # the agent runs its tool (holding no seat)
                await asyncio.sleep(s.think_s)

    await asyncio.gather(*(session(s, o) for s, o in zip(sessions, offsets)))
    sent = [r for r in results if r.e2e is not None]
    duration = max((r.sent + r.e2e for r in sent), default=0.0) - min((r.sent for r in sent), default=0.0)
    return results, duration, not_sent


async def scrape_prefix_cache(client, url: str) -> dict | None:
    """pdserve's prefix-cache counters by role, or None (no /metrics, or not pdserve's)."""
    import httpx
    try:
        resp = await client.get(url + "/metrics", timeout=10)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    return parse_prefix_cache(resp.text) or None


async def bench(args, endpoints: list[tuple[str, str]], transport=None) -> tuple[dict, dict, list]:
    """Every endpoint × load point -> (JSON results, TTFT samples per run, table rows).
    `transport`: an httpx transport to use instead of the network (tests)."""
    import httpx

    # pdserve sends each request's TTFT breakdown when asked (a header other servers ignore)
    headers = {TIMING_HEADER: "1"} | ({"Authorization": f"Bearer {args.api_key}"} if args.api_key else {})
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)  # the default caps at 100
    extra = json.loads(args.extra_body) if args.extra_body else {}
    if not isinstance(extra, dict):
        raise ValueError("--extra-body must be a JSON object")
    opts = {"temperature": args.temperature, "ignore_eos": not args.no_ignore_eos, "extra": extra}
    if args.workload == "trace" and not args.trace:
        raise ValueError("--workload trace needs --trace FILE")
    trace = load_trace(args.trace) if args.workload == "trace" else None
    points = load_points(args.request_rates, args.request_rate, args.max_concurrency, args.workload == "trace")
    out = {"settings": {k: v for k, v in vars(args).items() if k not in ("func", "api_key")}, "endpoints": {}}
    samples, rows = {}, []
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits, headers=headers,
                                 transport=transport) as client:
        models = {name: args.model or await first_model(client, url) for name, url in endpoints}
        tokenizer, out["tokenizer"] = resolve_tokenizer(args.tokenizer, models[endpoints[0][0]])
        vocab = Vocabulary(tokenizer)
        out["length_unit"] = "tokens" if vocab.exact else "words (approximate tokens)"
        workloads = [build_workload(args, vocab, args.seed + i, trace) for i in range(len(points))]
        for name, url in endpoints:
            runs = []
            for (rate, conc), sessions in zip(points, workloads):
                label = load_label(rate, conc)
                offsets = (trace_offsets([s.arrival for s in sessions], rate) if args.workload == "trace"
                           else arrival_offsets(len(sessions), rate, args.burstiness, args.seed))
                progress = Progress(f"{name} {label}", sum(len(s.turns) for s in sessions))
                before = await scrape_prefix_cache(client, url)
                results, duration, not_sent = await run_load_point(client, url, models[name], sessions, offsets,
                                                                   conc, args.max_duration, opts, progress)
                progress.close()
                if before is not None:
                    await asyncio.sleep(METRICS_SETTLE_S)
                prefix = prefix_cache_delta(before, await scrape_prefix_cache(client, url))
                m = summarize(results, duration, args.slo_ttft, args.slo_tpot) | {"not_sent": not_sent}
                run = {"label": label, "request_rate": "trace" if rate is None else "inf" if math.isinf(rate) else rate,
                       "burstiness": args.burstiness, "max_concurrency": conc, "workload": workload_summary(sessions),
                       "metrics": m, "prefix_cache": prefix}
                if args.save_requests:
                    run["requests"] = [asdict(r) for r in results]
                runs.append(run)
                samples[(name, label)] = sorted(r.ttft for r in results if r.ok)
                rows.append(table_row(name, label, m, prefix))
            out["endpoints"][name] = {"url": url, "model": models[name], "runs": runs}
    return out, samples, rows


def cmd_bench_serving(args) -> int:
    try:
        import httpx  # noqa: F401
    except ImportError:
        raise ValueError("pdserve bench needs httpx: pip install httpx") from None
    from .plots import write_plots

    if args.workload == "noisy-neighbour":
        from .noisy import cmd_noisy
        return cmd_noisy(args)
    endpoints = parse_endpoints(args.endpoints, args.base_url)
    results, samples, rows = asyncio.run(bench(args, endpoints))
    path = Path(args.output)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(format_table(rows))
    for name, ep in results["endpoints"].items():
        for run in ep["runs"]:
            if run["metrics"]["ttft_breakdown"]:
                print(format_breakdown(name, run["label"], run["metrics"]["ttft_breakdown"]))
    print(f"latencies in ms; lengths in {results['length_unit']}; goodput: req/s with TTFT <= {args.slo_ttft}s "
          f"and TPOT <= {args.slo_tpot}s; wrote {path}", file=sys.stderr)
    if args.plot_dir:
        for p in write_plots(Path(args.plot_dir), results, samples):
            print(f"wrote {p}", file=sys.stderr)
    return 0
