"""`pdserve bench-peers`: pdserve side by side with the servers a user would otherwise run,
one after another on this machine, each with the same workloads of `pdserve bench`.

Systems: pdserve disaggregated (1 prefill + 1 decode worker), pdserve aggregated (one worker
that prefills and decodes), the same with weight-only int8 weights, the transformers baseline (`pdserve baseline-server`), and, when
installed, llama.cpp's server (`llama-cpp-python`) and vLLM; missing ones are skipped.
Each system is started, timed until it answers a completion (time to ready), measured, and
stopped (SIGINT to the process started here, then SIGKILL after a grace period).

Phases, the same for every system:
- single: 1 stream, 128-token prompts, 128 tokens out -> decode tok/s of one stream (1/TPOT)
- ttft512: 1 stream, 512-token prompts, 4 tokens out -> TTFT
- load: 8 and 32 concurrent streams, 128 in / 128 out -> output tok/s at each load
Then pdserve with 2 prefill workers on a shared-prefix workload, prefix-aware vs round-robin
routing (a prefill KV cache that holds about half of the groups' system prompts).
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from pdserve.engine.quant import QUANTIZATIONS

from .metrics import format_table
from .serving import add_bench_serving_args, bench

PHASES = {
    "single": ["--max-concurrency", "1", "--num-requests", "4", "--input-len", "128", "--output-len", "128"],
    "ttft512": ["--max-concurrency", "1", "--num-requests", "6", "--input-len", "512", "--output-len", "4"],
    "load": ["--max-concurrency", "8,32", "--num-requests", "64", "--input-len", "128", "--output-len", "128"],
}
PREFIX_PHASE = ["--workload", "shared-prefix", "--num-groups", "8", "--prompts-per-group", "6",
                "--system-prompt-len", "768", "--question-len", "32", "--output-len", "8", "--max-concurrency", "4"]
QUICK = {"single": ["--max-concurrency", "1", "--num-requests", "2", "--input-len", "32", "--output-len", "8"]}


def systems(args, port: int) -> dict[str, list[str] | None]:
    """name -> command line (None: not installed here)."""
    py = [sys.executable, "-m", "pdserve"]
    common = ["--kv-cache-memory", args.kv_cache_memory, "--quantization", args.quantization]
    # the aggregated worker gets every core, as the other servers do; disaggregated splits them
    aggregated = ["up", "--port", str(port), "--mode", "aggregated", "--decode-cpus", str(os.cpu_count() or 1)]
    out = {
        "pdserve": py + ["up", "--port", str(port), *common],
        "pdserve-aggregated": py + [*aggregated, *common],
        # weight-only int8 (perplexity +0.5%): the fast single-stream configuration
        "pdserve-aggregated-int8": py + [*aggregated, "--kv-cache-memory", args.kv_cache_memory,
                                         "--quantization", "int8"],
        "transformers": py + ["baseline-server", "--port", str(port), "--max-batch", "32"],
        "llama.cpp": None, "vllm": None,
    }
    from pdserve.engine.weights import default_model_path
    if importlib.util.find_spec("llama_cpp") is not None:
        out["llama.cpp"] = [sys.executable, "-m", "llama_cpp.server", "--model", str(default_model_path()),
                            "--port", str(port), "--n_threads", str(os.cpu_count() or 1), "--n_ctx", "4096",
                            # by default a new request cancels the one in flight: queue them instead
                            "--interrupt_requests", "False"]
    if importlib.util.find_spec("vllm") is not None:
        gguf = default_model_path()
        out["vllm"] = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(gguf),
                       "--tokenizer", "HuggingFaceTB/SmolLM2-135M-Instruct", "--port", str(port),
                       "--served-model-name", "SmolLM2-135M-Instruct"]
    return out


class Server:
    """One system under test, started here and stopped by its own PID."""

    def __init__(self, name: str, cmd: list[str], port: int, log_dir: Path):
        self.name, self.cmd, self.url = name, cmd, f"http://127.0.0.1:{port}"
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{name}.log"
        env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled", PYTHONWARNINGS="ignore")
        self.t0 = time.perf_counter()
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float) -> float:
        """Seconds from start until a 1-token completion succeeds."""
        import httpx

        deadline = self.t0 + timeout
        body = {"prompt": "Hello", "max_tokens": 1, "temperature": 0}
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log_path}")
            try:
                models = httpx.get(self.url + "/v1/models", timeout=5).json()["data"]
                r = httpx.post(self.url + "/v1/completions", json=body | {"model": models[0]["id"]}, timeout=30)
                if r.status_code == 200:
                    return time.perf_counter() - self.t0
            except (httpx.HTTPError, KeyError, IndexError, ValueError):
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} not ready after {timeout:.0f}s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def bench_args(extra: list[str], out_dir: Path):
    p = argparse.ArgumentParser()
    add_bench_serving_args(p)
    return p.parse_args(extra + ["--output", str(out_dir / "unused.json"), "--timeout", "900"])


def run_phases(name: str, url: str, phases: dict[str, list[str]], out_dir: Path, merged: dict) -> None:
    for phase, extra in phases.items():
        res, samples, rows = asyncio.run(bench(bench_args(extra, out_dir), [(name, url)]))
        slot = merged.setdefault(phase, {"results": None, "samples": {}, "rows": []})
        if slot["results"] is None:
            slot["results"] = res
        else:
            slot["results"]["endpoints"].update(res["endpoints"])
        slot["samples"].update(samples)
        slot["rows"] += rows


def headline(merged: dict, ready: dict) -> dict:
    """Per system: the figures the README table shows."""
    def run(phase, name, label=None):
        runs = merged.get(phase, {}).get("results", {}) or {}
        ep = runs.get("endpoints", {}).get(name)
        if not ep:
            return None
        return next((r["metrics"] for r in ep["runs"] if label is None or r["label"].endswith(label)), None)

    out = {}
    for name in ready:
        single, ttft, = run("single", name), run("ttft512", name)
        c8, c32 = run("load", name, "c=8"), run("load", name, "c=32")
        tpot = single and single["tpot_ms"]["p50"]
        out[name] = {
            "ready_s": ready[name],
            "single_stream_tok_s": 1000 / tpot if tpot else None,
            "ttft_p50_ms_512": ttft and ttft["ttft_ms"]["p50"],
            "output_tok_s_c8": c8 and c8["output_throughput"],
            "output_tok_s_c32": c32 and c32["output_throughput"],
            "tpot_p50_ms_c32": c32 and c32["tpot_ms"]["p50"],
            "failed": sum((m or {}).get("failed", 0) for m in (single, ttft, c8, c32)),
            # requests that ended before their max_tokens (a server ignoring ignore_eos):
            # their throughput is not comparable and the table says so
            "short_outputs": sum((m or {}).get("output_len_mismatches", 0) for m in (single, ttft, c8, c32)),
        }
    return out


def markdown(head: dict, prefix: dict | None, baseline: str = "transformers") -> str:
    cols = [("ready_s", "ready (s)", "{:.1f}"), ("single_stream_tok_s", "1 stream tok/s", "{:.1f}"),
            ("ttft_p50_ms_512", "TTFT p50, 512 tok (ms)", "{:.0f}"), ("output_tok_s_c8", "8 streams tok/s", "{:.0f}"),
            ("output_tok_s_c32", "32 streams tok/s", "{:.0f}"), ("tpot_p50_ms_c32", "TPOT p50 @32 (ms)", "{:.0f}")]
    lines = ["| system | " + " | ".join(c[1] for c in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    base = head.get(baseline, {})
    for name, h in head.items():
        cells = []
        for key, _, fmt in cols:
            v = h.get(key)
            cell = "-" if v is None else fmt.format(v)
            if v is not None and base.get(key) and name != baseline and key not in ("ready_s",):
                cell += f" ({v / base[key]:.2f}x)"
            cells.append(cell)
        short = f" ({h['short_outputs']} outputs shorter than asked)" if h.get("short_outputs") else ""
        lines.append(f"| {name}{short} | " + " | ".join(cells) + " |")
    lines.append(f"\n(x): ratio to {baseline} in the same run; higher is better for tok/s, lower for TTFT/TPOT.")
    if prefix:
        lines += ["", "| shared prefix, 2 prefill workers | TTFT p50 (ms) | TTFT p90 (ms) | prefix hit rate |",
                  "|---|---|---|---|"]
        base_p50 = prefix.get("round_robin", {}).get("ttft_ms", {}).get("p50")
        for name, m in prefix.items():
            hit = m.get("prefix_hit_rate")
            ratio = f" ({base_p50 / m['ttft_ms']['p50']:.2f}x lower)" if base_p50 and name != "round_robin" else ""
            lines.append(f"| {name} | {m['ttft_ms']['p50']:.0f}{ratio} | {m['ttft_ms']['p90']:.0f} | "
                         f"{'-' if hit is None else f'{hit:.0%}'} |")
    return "\n".join(lines) + "\n"


def add_bench_peers_args(p) -> None:
    p.add_argument("--systems", default="pdserve,pdserve-aggregated,pdserve-aggregated-int8,transformers,llama.cpp,vllm",
                   help="systems to compare, in order (missing ones are skipped) (default: %(default)s)")
    p.add_argument("--port", type=int, default=8300, help="port each system serves on in turn")
    p.add_argument("--kv-cache-memory", default="1GiB", help="pdserve's KV cache per worker (default: %(default)s)")
    p.add_argument("--quantization", default="none", choices=QUANTIZATIONS, help="pdserve's weights")
    p.add_argument("--no-prefix-routing", action="store_true", help="skip prefix-aware vs round-robin")
    p.add_argument("--quick", action="store_true", help="one tiny phase per system (a smoke test)")
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--output", default="bench/peers-results.json")
    p.add_argument("--plot-dir", default="bench/plots/peers", help="PNG plots per phase ('' for none)")
    p.set_defaults(func=cmd_bench_peers)


def prefix_routing(args, out_dir: Path, log) -> dict:
    """TTFT of a shared-prefix workload through 2 prefill workers, per routing policy."""
    py = [sys.executable, "-m", "pdserve", "up", "--port", str(args.port), "--prefill", "2",
          "--kv-cache-memory", "160MiB", "--quantization", args.quantization,
          "--decode-local-prefill", "0"]  # every prompt through the prefill pool: this compares its routing
    out = {}
    for policy in ("round_robin", "prefix_aware"):
        srv = Server(f"pdserve-2prefill-{policy}", py + ["--routing", policy], args.port, out_dir / "logs")
        try:
            srv.wait_ready(args.ready_timeout)
            res, _, rows = asyncio.run(bench(bench_args(PREFIX_PHASE, out_dir), [(policy, srv.url)]))
        finally:
            srv.stop()
        r = res["endpoints"][policy]["runs"][0]
        out[policy] = r["metrics"] | {"prefix_hit_rate": (r["prefix_cache"] or {}).get("hit_rate")}
        log(format_table(rows))
    return out


def cmd_bench_peers(args) -> int:
    from .plots import write_plots

    log = lambda *a: print(*a, file=sys.stderr, flush=True)
    out_path = Path(args.output)
    out_dir = out_path.parent
    cmds = systems(args, args.port)
    wanted = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in cmds]
    if unknown:
        raise ValueError(f"--systems: unknown {unknown}; known: {', '.join(cmds)}")
    phases = QUICK if args.quick else PHASES
    merged, ready, skipped = {}, {}, {}
    for name in wanted:
        if cmds[name] is None:
            skipped[name] = "not installed"
            log(f"{name}: not installed, skipped")
            continue
        srv = Server(name, cmds[name], args.port, out_dir / "logs")
        try:
            ready[name] = srv.wait_ready(args.ready_timeout)
            log(f"{name}: ready in {ready[name]:.1f}s")
            run_phases(name, srv.url, phases, out_dir, merged)
        except (RuntimeError, TimeoutError) as e:
            skipped[name] = str(e)
            log(f"{name}: {e}")
        finally:
            srv.stop()
    prefix = None if args.quick or args.no_prefix_routing else prefix_routing(args, out_dir, log)
    head = headline(merged, ready)
    table = markdown(head, prefix)
    result = {"headline": head, "prefix_routing": prefix, "skipped": skipped, "markdown": table,
              "phases": {k: v["results"] for k, v in merged.items()}}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    for phase, slot in merged.items():
        log(format_table(slot["rows"]))
        if args.plot_dir and slot["results"]:
            for p in write_plots(Path(args.plot_dir) / phase, slot["results"], slot["samples"]):
                log(f"wrote {p}")
    print(table)
    log(f"wrote {out_path}")
    return 0 if ready else 1
