"""Metrics of `pdserve bench`: pure functions from per-request records to the numbers users
compare servers by (no network; the tests drive them with made-up records).

- TTFT: request sent -> first streamed content chunk.
- ITL: every gap between two consecutive content chunks (pooled over requests).
- TPOT: per request (e2e - ttft) / (output tokens - 1): the mean decode step it saw.
- E2E: request sent -> end of the stream.
- Throughput over the run's duration (first request sent -> last one finished); goodput
  counts only requests that met both SLOs (TTFT and TPOT). A failed request (a 429, a 5xx,
  a broken stream) is a miss, reported by status.
- Prefix-cache hit rate: the change of pdserve's per-worker prefix-cache counters over the run.
- TTFT breakdown: where the server says each request's first token went (pdserve's `timing`,
  asked for with the X-PDServe-Timing header; other servers send none): the router's queue,
  the decode worker's wait for blocks, the prefill queue, compute and KV push, and the rest
  of the client's TTFT (network, a prefill on the decode worker, the first decode step).
"""
from __future__ import annotations

import math
import os
import re
from collections import Counter
from dataclasses import dataclass, field

PERCENTILES = (50, 90, 95, 99)


@dataclass
class RequestResult:
    """One request as the client saw it; times in seconds."""
    status: str                 # "ok", the HTTP status ("429"), or what broke ("ReadTimeout", "stream_error")
    sent: float                 # when it was sent, from the start of the run
    input_len: int              # prompt length asked for (tokens, or words when approximated)
    output_len: int             # output length asked for (max_tokens)
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0      # the server's usage count, else the number of content chunks
    prompt_tokens: int | None = None  # the server's usage count, when it sends one
    error: str = ""
    timing: dict | None = None  # the server's breakdown of this request's time (pdserve's `timing`)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (None with fewer than 2 tokens)."""
        if not self.ok or self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def percentile(xs: list[float], q: float) -> float | None:
    """The q-th percentile with linear interpolation between closest ranks (numpy's default)."""
    if not xs:
        return None
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def distribution_ms(xs: list[float]) -> dict:
    """mean and percentiles of `xs` (seconds) in milliseconds; None values when empty."""
    out = {"mean": 1e3 * sum(xs) / len(xs) if xs else None}
    for q in PERCENTILES:
        p = percentile(xs, q)
        out[f"p{q}"] = None if p is None else 1e3 * p
    return out


def meets_slo(r: RequestResult, slo_ttft: float | None, slo_tpot: float | None) -> bool:
    """Whether a request counts toward goodput: it succeeded, its TTFT is within `slo_ttft`
    and its TPOT within `slo_tpot` (a one-token output has no TPOT: only TTFT applies).
    An SLO of None is not checked."""
    if not r.ok:
        return False
    if slo_ttft is not None and (r.ttft is None or r.ttft > slo_ttft):
        return False
    tpot = r.tpot
    return slo_tpot is None or tpot is None or tpot <= slo_tpot


def summarize(results: list[RequestResult], duration: float, slo_ttft: float | None = None,
              slo_tpot: float | None = None) -> dict:
    """Every metric of one run. `duration` (s) is the denominator of the throughputs."""
    ok = [r for r in results if r.ok]
    good = [r for r in results if meets_slo(r, slo_ttft, slo_tpot)]
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else r.input_len for r in ok)
    return {
        "requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "failed_by_status": dict(sorted(Counter(r.status for r in results if not r.ok).items())),
        "duration_s": duration,
        "input_tokens": in_tokens, "output_tokens": out_tokens,
        # with ignore_eos every completed request should produce exactly what it asked for
        "output_len_mismatches": sum(r.output_tokens != r.output_len for r in ok),
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(out_tokens),
        "total_token_throughput": per_s(in_tokens + out_tokens),
        "goodput": per_s(len(good)),
        "slo_attainment": len(good) / len(results) if results else None,
        "slo": {"ttft_s": slo_ttft, "tpot_s": slo_tpot},
        # Little's law: the mean number of requests in flight
        "mean_concurrency": per_s(sum(r.e2e for r in ok if r.e2e is not None)),
        "ttft_ms": distribution_ms([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": distribution_ms([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": distribution_ms([g for r in ok for g in r.itl]),
        "e2e_ms": distribution_ms([r.e2e for r in ok if r.e2e is not None]),
        "ttft_breakdown": ttft_breakdown(results),
    }


# ---- the server's TTFT breakdown ------------------------------------------------------------
BREAKDOWN = (("queue_s", "router queue"), ("blocks_wait_s", "blocks wait"), ("prefill_queue_s", "prefill queue"),
             ("prefill_compute_s", "prefill compute"), ("kv_push_s", "KV push"), ("rest_s", "rest"))


def ttft_parts(r: RequestResult) -> dict[str, float]:
    """A request's TTFT in the server's parts (seconds); a part it had none of is 0 (a prompt
    prefilled on its decode worker has no hand-off: its prefill is in `rest_s`)."""
    parts = {k: float(r.timing.get(k, 0.0)) for k, _ in BREAKDOWN[:-1]}
    return parts | {"rest_s": max(r.ttft - sum(parts.values()), 0.0)}


def ttft_breakdown(results: list[RequestResult]) -> dict | None:
    """The run's TTFT by part: each part's distribution, their means over the slowest tenth
    of requests by TTFT (what the tail waited on), and the share prefilled remotely; None
    when the server sent no breakdown."""
    timed = [r for r in results if r.ok and r.ttft is not None and r.timing]
    if not timed:
        return None
    parts = [ttft_parts(r) for r in timed]
    p90 = percentile([r.ttft for r in timed], 90)
    tail = [p for p, r in zip(parts, timed) if r.ttft >= p90]
    return {"requests": len(timed),
            "prefilled_remotely": sum(bool(r.timing.get("prefilled_remotely")) for r in timed) / len(timed),
            "parts_ms": {k: distribution_ms([p[k] for p in parts]) for k, _ in BREAKDOWN},
            "tail_mean_ms": {k: 1e3 * sum(p[k] for p in tail) / len(tail) for k, _ in BREAKDOWN}}


def format_breakdown(endpoint: str, label: str, b: dict) -> str:
    """One run's TTFT breakdown as a line: each part's p50/p99, then what the slowest tenth waited on."""
    parts = ", ".join(f"{name} {b['parts_ms'][k]['p50']:.0f}/{b['parts_ms'][k]['p99']:.0f}" for k, name in BREAKDOWN)
    tail = ", ".join(f"{name} {b['tail_mean_ms'][k]:.0f}" for k, name in BREAKDOWN)
    return (f"{endpoint} {label}: TTFT parts p50/p99 ms: {parts}; slowest 10% (mean ms): {tail}; "
            f"{b['prefilled_remotely']:.0%} prefilled remotely")


# ---- the server's prefix-cache counters ----------------------------------------------------
# counters (`_total`); a pdserve before 0.1 exported them as gauges without the suffix
_PREFIX_LINE = re.compile(r'^pdserve_prefix_cache_(queries|hits)_tokens(?:_total)?\{([^}]*)\}\s+(\S+)', re.MULTILINE)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
ROLE_PREFERENCE = ("prefill", "aggregated", "decode")  # the order roles are named in


def parse_prefix_cache(metrics_text: str) -> dict[str, dict[str, float]]:
    """{role: {"queries": tokens, "hits": tokens}} summed over workers, from Prometheus text
    with pdserve's `pdserve_prefix_cache_{queries,hits}_tokens{worker,role}` gauges. Empty
    when the server exports no such metrics."""
    out: dict[str, dict[str, float]] = {}
    for kind, labels, value in _PREFIX_LINE.findall(metrics_text):
        role = dict(_LABEL.findall(labels)).get("role", "")
        try:
            v = float(value)
        except ValueError:
            continue
        if math.isfinite(v):
            d = out.setdefault(role, {"queries": 0.0, "hits": 0.0})
            d[kind] += v
    return out


def prefix_cache_delta(before: dict | None, after: dict | None) -> dict | None:
    """The hit rate over a run: Δhits / Δqueries summed over the roles that saw queries.
    Workers count a prompt where they compute it (a prefill worker, or a decode or
    aggregated worker that prefills it itself), so each prompt is counted once. None when
    either scrape is missing or nothing was looked up (e.g. another server, or a worker
    restarted and its counters went back)."""
    if not before or not after:
        return None
    roles, dq, dh = [], 0.0, 0.0
    for role in ROLE_PREFERENCE + tuple(sorted(set(after) - set(ROLE_PREFERENCE))):
        if role not in after:
            continue
        b = before.get(role, {"queries": 0.0, "hits": 0.0})
        q, h = after[role]["queries"] - b["queries"], after[role]["hits"] - b["hits"]
        if q < 0 or not 0 <= h <= max(q, 0):
            return None  # counters went back: a restart
        if q > 0:
            roles.append(role)
            dq, dh = dq + q, dh + h
    if not dq:
        return None
    return {"role": "+".join(roles), "queries_tokens": dq, "hits_tokens": dh, "hit_rate": dh / dq}


# ---- the printed table ----------------------------------------------------------------------
COLUMNS = (("endpoint", "s"), ("load", "s"), ("ok/all", "s"), ("req/s", ".2f"), ("goodput", ".2f"),
           ("out tok/s", ".1f"), ("TTFT p50", ".0f"), ("p99", ".0f"), ("TPOT p50", ".0f"), ("p99", ".0f"),
           ("ITL p50", ".0f"), ("p99", ".0f"), ("E2E p50", ".0f"), ("p99", ".0f"), ("prefix hit", "s"))


def load_label(rate: float | None, concurrency: int | None) -> str:
    """'rate 2/s', 'rate inf c=4', 'trace'...: one load point of a sweep."""
    parts = ["trace" if rate is None else f"rate {'inf' if math.isinf(rate) else f'{rate:g}/s'}"]
    if concurrency:
        parts.append(f"c={concurrency}")
    return " ".join(parts)


def table_row(endpoint: str, label: str, m: dict, prefix: dict | None) -> list:
    """One line of the table: a run's headline numbers (latencies in ms)."""
    return [endpoint, label, f"{m['completed']}/{m['requests']}", m["request_throughput"], m["goodput"],
            m["output_throughput"], m["ttft_ms"]["p50"], m["ttft_ms"]["p99"], m["tpot_ms"]["p50"],
            m["tpot_ms"]["p99"], m["itl_ms"]["p50"], m["itl_ms"]["p99"], m["e2e_ms"]["p50"], m["e2e_ms"]["p99"],
            "-" if prefix is None else f"{prefix['hit_rate']:.1%}"]


def format_table(rows: list[list]) -> str:
    """A fixed-width text table, text columns left-aligned; missing values print as '-'."""
    cells = [[name for name, _ in COLUMNS]]
    cells += [["-" if v is None else format(v, fmt) for v, (_, fmt) in zip(row, COLUMNS)] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(COLUMNS))]
    left = {0, 1}
    return "\n".join("  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in cells)


def cpu_description() -> dict:
    """Which CPU the figures came from: `lscpu`'s model name, its family and model numbers (a
    model name of "AMD EPYC" alone does not tell Zen 3 from Zen 5: family 25 is Zen 3 and 4,
    26 Zen 5), this process's cores and the vector extensions."""
    from pdserve.engine.kernels.native import cpu_flags, isa  # torch: only when a result is written

    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for ln in f:
                key, _, value = ln.partition(":")
                if key.strip() in ("model name", "cpu family", "model") and key.strip() not in info:
                    info[key.strip()] = value.strip()
                if not ln.strip():
                    break  # the first processor's lines are enough
    except OSError:
        pass
    flags = cpu_flags()
    return {"model": info.get("model name", ""), "family": info.get("cpu family", ""), "model_id": info.get("model", ""),
            "cores": len(os.sched_getaffinity(0)),
            "isa": sorted(f for f in flags if f.startswith(("avx", "amx")) or f == "fma"),
            "kernels": isa()}  # the instruction set pdserve's C kernels were built for
