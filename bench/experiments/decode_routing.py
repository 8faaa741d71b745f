"""Decode-side routing, one run: a shared-prefix workload (8 groups x 6 prompts, 768-token
system prompts, 32-token questions, 8 tokens out, 4 in flight) through real `pdserve up`
clusters, each started, measured and stopped in turn:

- aggregated x2: decode workers picked by load alone (`--routing least_loaded`) vs by load
  and the prefix they hold (`prefix_aware`): a worker that holds the system prompt does not
  compute it again;
- 1 prefill + 2 decode workers, prefix_aware: every prompt through the prefill pool
  (`--decode-local-prefill 0`) vs the default, where a decode worker prefills a prompt
  itself when at most 64 of its tokens are not in its own cache (no prefill round trip, no
  KV transfer);
- a burst of 32 streams (128 in / 128 out) on 1 prefill + 2 decode workers: how the
  requests spread over the decode workers;
- `pdserve up` as it starts by default (1 prefill + 1 decode worker), multi-turn chats
  (8 conversations x 4 turns, 256-token system prompt, 24-token turns): each turn's history
  is in the decode worker's cache, so only the new part is prefilled there.

Writes bench/experiments/decode-routing-results.json.

    . .venv/bin/activate && python bench/experiments/decode_routing.py
"""
import asyncio
import json
import re
import sys
from pathlib import Path

from pdserve.bench.metrics import format_table
from pdserve.bench.peers import PREFIX_PHASE, Server, bench_args
from pdserve.bench.serving import bench

OUT = Path(__file__).resolve().parent
PORT = 8391
BURST = ["--max-concurrency", "32", "--num-requests", "64", "--input-len", "128", "--output-len", "128"]
AGG = ["--mode", "aggregated", "--decode", "2", "--decode-cpus", "1", "--threads", "1", "--kv-cache-memory", "200MiB"]
DISAGG = ["--prefill", "1", "--decode", "2", "--prefill-cpus", "0.5", "--decode-cpus", "0.5", "--threads", "1",
          "--kv-cache-memory", "200MiB"]
# multi-turn chat: each turn resends the history, which the decode worker holds (prompt and answer)
CHAT = ["--workload", "multi-turn", "--num-conversations", "8", "--num-turns", "4", "--system-prompt-len", "256",
        "--input-len", "24", "--output-len", "24", "--max-concurrency", "4"]
CHAT_UP = ["--kv-cache-memory", "200MiB"]
CASES = {
    "aggregated x2, decode by load": (AGG + ["--routing", "least_loaded"], PREFIX_PHASE),
    "aggregated x2, decode by load + prefix": (AGG, PREFIX_PHASE),
    "1P+2D, all prompts via the prefill pool": (DISAGG + ["--decode-local-prefill", "0"], PREFIX_PHASE),
    "1P+2D, short tails prefilled on decode": (DISAGG, PREFIX_PHASE),
    "1P+2D, burst of 32 streams": (DISAGG, BURST),
    "1P+1D (pdserve up's default), chat, all via the prefill pool": (CHAT_UP + ["--decode-local-prefill", "0"], CHAT),
    "1P+1D (pdserve up's default), chat, default": (CHAT_UP, CHAT),
}
WANTED = re.compile(r'^pdserve_(kv_transfer_bytes|decode_prefills|prefix_cache_hits_tokens|'
                    r'prefix_cache_queries_tokens)(?:_total)?\{(.*)\} (\S+)$')


def worker_metrics(url: str) -> dict:
    import httpx

    out: dict = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        m = WANTED.match(line)
        if m:
            labels = dict(kv.split("=") for kv in m.group(2).replace('"', "").split(","))
            out.setdefault(m.group(1), {})[labels["worker"] + ("/" + labels["where"] if "where" in labels else "")] = \
                float(m.group(3))
    return out


def main() -> None:
    py = [sys.executable, "-m", "pdserve", "up", "--port", str(PORT)]
    results, rows = {}, []
    for name, (up_args, phase) in CASES.items():
        srv = Server(name.replace(" ", "_").replace(",", "").replace("+", "p"), py + up_args, PORT, OUT / "logs")
        try:
            ready = srv.wait_ready(600)
            res, _, table = asyncio.run(bench(bench_args(phase, OUT), [(name, srv.url)]))
            workers = worker_metrics(srv.url)
        finally:
            srv.stop()
        run = res["endpoints"][name]["runs"][0]
        results[name] = {"up": up_args, "ready_s": ready, "metrics": run["metrics"], "workers": workers}
        rows += table
        print(format_table(table), file=sys.stderr, flush=True)
    print(format_table(rows))
    for name, r in results.items():
        w = r["workers"]
        kv = sum(v for k, v in w.get("kv_transfer_bytes", {}).items() if k.startswith("prefill"))
        print(f"{name}: KV sent {kv / 1e6:.0f} MB; decode prefills {w.get('decode_prefills', {})}")
    (OUT / "decode-routing-results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
