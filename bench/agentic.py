"""The agentic benchmark of the KV tiers: `python -m pdserve.bench.agentic`.

Agent sessions (`pdserve bench --workload agentic`: tools, a task, then tool results appended
to the whole history, a think time between turns) against `pdserve up`, run in one go with the
KV tiers off (`--kv-host-memory 0`: an evicted history is computed again) and on (the default
host tier: it is copied back) on one aggregated worker (every turn computed in one pool), then with 2 aggregated workers (each prefills its own prompts)
with peer prefix pulls off and on (`--kv-peer-pull`: a worker the router sends a session to
pulls the history another worker holds instead of computing it). Each configuration gets its
own seed (no reuse across them).

The defaults make the claim measurable: the sessions' histories together outgrow each
worker's KV pool while the requests in flight at any moment fit in it. 12 sessions of 6 turns
(a 400-token system prompt of tools, then 100-200 tokens of tool result and a 24-token reply
per turn: histories grow to ~1,500 tokens, ~12,000 for all sessions together) start 2 s apart
on average (`--session-rate 0.5`, regular gaps: `--burstiness 4`) and think 5 s between turns,
so that only a few requests are in flight at once; a 192 MiB pool holds ~4,400 tokens of SmolLM2's fp32 KV
(about 3 sessions' histories). A session coming back after its think time then finds its
history evicted from the pool: without tiers it computes all of it again, with tiers it copies
it back and computes only the new turn.

Reports per configuration TTFT p50/p99, requests/s, the prefix hit rate, and per request (each
prompt is counted once, where it is computed): the prompt tokens looked up, found in the pool,
and copied back from each tier, by worker role; the blocks pulled from peers. Writes
bench/agentic-results.json with the CPU it ran on.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from .metrics import cpu_description
from .peers import Server, bench_args
from .serving import bench

TWO_WORKERS = ["--mode", "aggregated", "--decode", "2"]
# the tiers are measured on one aggregated worker: every turn of every session is computed in
# one pool. In the default disaggregated cluster an idle decode worker prefills prompts itself,
# so a session's turns alternate between two pools, a history is missing where a turn is
# computed with tiers or without, and the prefill worker pulls it from the decode worker's pool
ONE_WORKER = ["--mode", "aggregated", "--decode", "1"]
CONFIGS = {"tiers off": ONE_WORKER + ["--kv-host-memory", "0"],
           "tiers on (default host tier)": ONE_WORKER,
           "2 workers, peer pulls off": TWO_WORKERS + ["--kv-peer-pull", "off"],
           "2 workers, peer pulls on (default)": TWO_WORKERS}


def metric_sums(url: str, name: str, label: str) -> dict[str, float]:
    """The counter `name` summed over the workers, by the value of its label `label` (/metrics)."""
    import httpx

    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{"):
            key = line.split(f'{label}="')[1].split('"')[0]
            out[key] = out.get(key, 0.0) + float(line.split()[-1])
    return out


def tier_hits(url: str) -> dict[str, float]:
    """Prompt tokens copied back from each KV tier, summed over the workers."""
    return metric_sums(url, "pdserve_kv_tier_hits_tokens_total", "tier")


def tier_hits_by_role(url: str) -> dict[str, dict[str, float]]:
    """Prompt tokens copied back from each KV tier, by worker role (a decode worker copies a
    prompt's prefix back from its own tiers before the prefill worker's KV of the rest lands)."""
    import httpx

    out: dict[str, dict[str, float]] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("pdserve_kv_tier_hits_tokens_total{"):
            role, tier = (line.split(f'{k}="')[1].split('"')[0] for k in ("role", "tier"))
            out.setdefault(role, {})[tier] = out.get(role, {}).get(tier, 0.0) + float(line.split()[-1])
    return out


def per_request(run: dict, by_role: dict[str, dict[str, float]], pulled: float) -> dict:
    """Per completed request: prompt tokens looked up and found (in the pool or a tier, where
    the prompt is computed), copied back from each tier by worker role, peer blocks pulled."""
    n = max(run["metrics"]["completed"], 1)
    cache = run.get("prefix_cache") or {}
    return {"requests": run["metrics"]["completed"],
            "queried_tokens": cache.get("queries_tokens", 0.0) / n, "hit_tokens": cache.get("hits_tokens", 0.0) / n,
            "tier_hit_tokens": {role: {t: v / n for t, v in tiers.items()} for role, tiers in by_role.items()},
            "peer_blocks_pulled": pulled / n}


def workload(args, seed: int) -> list[str]:
    return ["--workload", "agentic", "--num-conversations", str(args.sessions), "--num-turns", str(args.turns),
            "--system-prompt-len", str(args.system_len), "--input-len", args.result_len, "--output-len",
            str(args.output_len), "--think-time", str(args.think), "--max-concurrency", str(args.sessions),
            "--request-rate", str(args.session_rate), "--burstiness", str(args.burstiness),
            "--seed", str(seed), "--temperature", "0"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kv-cache-memory", default="192MiB",
                   help="each worker's KV pool: about 3 sessions' histories (default: %(default)s)")
    p.add_argument("--sessions", type=int, default=12, help="agent sessions (default: %(default)s)")
    p.add_argument("--turns", type=int, default=6, help="requests per session (default: %(default)s)")
    p.add_argument("--system-len", type=int, default=400, help="tokens of tool definitions (default: %(default)s)")
    p.add_argument("--result-len", default="100:200", help="tokens of each tool result (default: %(default)s)")
    p.add_argument("--output-len", type=int, default=24, help="tokens of each reply (default: %(default)s)")
    p.add_argument("--think", type=float, default=5.0, help="seconds between a reply and the next turn "
                   "(default: %(default)s)")
    p.add_argument("--session-rate", type=float, default=0.5, help="sessions started per second "
                   "(default: %(default)s)")
    p.add_argument("--burstiness", type=float, default=4.0, help="of the gaps between session starts: 1 "
                   "Poisson, higher more regular (default: %(default)s)")
    p.add_argument("--port", type=int, default=8310)
    p.add_argument("--output", default="bench/agentic-results.json")
    p.add_argument("--configs", default=";".join(CONFIGS),
                   help="which of them to run, separated by ';' (the others' runs already in --output are kept)")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    out_dir = Path(args.output).parent
    res = {"cpu": cpu_description(), "args": vars(args), "runs": {}}
    if Path(args.output).exists() and set(args.configs.split(";")) != set(CONFIGS):
        res["runs"] = json.loads(Path(args.output).read_text()).get("runs", {})
    for i, (name, flags) in enumerate(CONFIGS.items()):
        if name not in args.configs.split(";"):
            continue
        cmd = [sys.executable, "-m", "pdserve", "up", "--port", str(args.port), "--kv-cache-memory",
               args.kv_cache_memory, *flags]
        srv = Server("agentic-" + "-".join(name.replace(",", "").split()[:4]), cmd, args.port, out_dir / "logs")
        try:
            srv.wait_ready(600)
            out, _, _ = asyncio.run(bench(bench_args(workload(args, 4000 + 100 * i), out_dir), [(name, srv.url)]))
            tiers, by_role = tier_hits(srv.url), tier_hits_by_role(srv.url)
            peer = {"blocks": metric_sums(srv.url, "pdserve_kv_peer_blocks_total", "direction"),
                    "pulls": metric_sums(srv.url, "pdserve_kv_peer_pulls_total", "outcome")}
        finally:
            srv.stop()
        run = out["endpoints"][name]["runs"][0]
        m = run["metrics"]
        res["runs"][name] = {"flags": flags, "finished": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                             "ttft_p50_ms": m["ttft_ms"]["p50"], "ttft_p99_ms": m["ttft_ms"]["p99"],
                             "request_s": m["request_throughput"], "failed": m["failed"],
                             "prefix_cache": run.get("prefix_cache"), "tier_hit_tokens": tiers, "peer": peer,
                             "per_request": per_request(run, by_role, peer["blocks"].get("pulled", 0.0))}
        print(f"{name}: TTFT p50 {m['ttft_ms']['p50']:.0f} ms, p99 {m['ttft_ms']['p99']:.0f} ms, "
              f"{m['request_throughput']:.2f} req/s, prefix hit rate "
              f"{(run.get('prefix_cache') or {}).get('hit_rate')}, tier hits (tokens) {tiers}, peer {peer}, "
              f"per request {res['runs'][name]['per_request']}",
              flush=True)
    for key, off, on in (("ttft_p50_ratio_off_over_on", "tiers off", "tiers on (default host tier)"),
                         ("peer_ttft_p50_ratio_off_over_on", "2 workers, peer pulls off",
                          "2 workers, peer pulls on (default)")):
        if off in res["runs"] and on in res["runs"]:
            res[key] = res["runs"][off]["ttft_p50_ms"] / res["runs"][on]["ttft_p50_ms"]
            print(f"TTFT p50 {off} / {on}: {res[key]:.2f}x")
    Path(args.output).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
