"""`pdserve bench-peers`: pdserve side by side with the servers a user would otherwise run,
one after another on this machine, each with the same workloads of `pdserve bench`.

Systems: pdserve disaggregated (1 prefill + 1 decode worker), pdserve aggregated (one worker
that prefills and decodes), the same with weight-only int8 weights, the transformers baseline (`pdserve baseline-server`), and, when
installed, llama.cpp's own `llama-server` (`make llama-cpp`, bench/llama_peer.py; else
`llama-cpp-python`'s server) and vLLM; missing ones are skipped. Every row names its numerics
(`NUMERICS`).
Each system is started, timed until it answers a completion (time to ready), measured, and
stopped (SIGINT to the process started here, then SIGKILL after a grace period).

Workloads, the same for every system, each load point on prompts that server has not seen
(every point has its own seed), temperature 0.7, streaming, closed loop at 1, 8 and 32 streams:
- prompt-heavy: ~250-token prompts, 64 tokens out
- decode-heavy: ~64-token prompts, 512 tokens out
- long-prompt: ~2,000-token prompts, 64 tokens out (1 and 8 streams)
- multi-turn: chat conversations of 3 turns, each resending the history (8 at a time)
Each point reports output tok/s, TTFT, TPOT and ITL, and goodput at the SLO (--slo-ttft,
--slo-tpot). The reference for ratios is vLLM where it runs, else the transformers baseline.
Then, optionally, pdserve with 2 prefill workers on a shared-prefix workload, prefix-aware vs
round-robin routing (a prefill KV cache that holds about half of the groups' system prompts).
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

from pdserve.engine.config import QUANTIZATIONS
from pdserve.engine.kernels.native.cpu import ISA_ENV, isa

from . import llama_peer, vllm_peer
from .procs import clear_leftovers, descendants
from .metrics import cpu_description, format_table
from .serving import add_bench_serving_args, bench

# workload -> (its flags, {streams: requests}); requests None: the workload's own count
WORKLOADS: dict[str, tuple[list[str], dict[int, int | None]]] = {
    "prompt-heavy": (["--input-len", "200:300", "--output-len", "64"], {1: 6, 8: 24, 32: 64}),
    "decode-heavy": (["--input-len", "48:80", "--output-len", "512"], {1: 1, 8: 8, 32: 32}),
    "long-prompt": (["--input-len", "1800:2200", "--output-len", "64"], {1: 3, 8: 8}),
    "multi-turn": (["--workload", "multi-turn", "--api", "chat", "--num-conversations", "8", "--num-turns", "3",
                    "--input-len", "60:140", "--output-len", "64", "--system-prompt-len", "200"], {8: None}),
}


# what each system computes with: the peer table sets int8-activation rows beside fp32 ones
NUMERICS = {
    "pdserve": "auto: Q4_1 weights x int8 activations, bf16 KV cache",
    "pdserve-aggregated": "auto: Q4_1 weights x int8 activations, bf16 KV cache",
    "pdserve-exact": "exact: fp32 math on the Q4_1 weights",
    "pdserve-kv-int8": "auto, int8 KV cache", "pdserve-kv-bf16": "auto, bf16 KV cache",
    "pdserve-kv-fp32": "auto, fp32 KV cache",
    "pdserve-avx2": "auto: Q4_1 weights x int8 activations (AVX2 kernels)", "pdserve-aggregated-int8": "int8 weights x fp32",
    "pdserve-vnni": "auto: Q4_1 weights x int8 activations (AVX-512 VNNI kernels, no AMX)",
    "llama.cpp": "Q4_1 weights x Q8_1 activations", "transformers": "fp32 (dequantized Q4_1)",
    "vllm-bf16": "bf16 (dequantized Q4_1)",
    "vllm-fp32": "fp32 (dequantized Q4_1)",
}


def numerics(name: str) -> str:
    """What `name` computes with on this CPU (vLLM's default dtype is chosen per CPU)."""
    if name == "vllm":
        return f"{vllm_peer.best_dtype()} (dequantized Q4_1)".replace("float32", "fp32").replace("bfloat16", "bf16")
    if name in ("pdserve", "pdserve-aggregated", "pdserve-kv-int8", "pdserve-kv-bf16", "pdserve-kv-fp32") \
            and isa() == "avx512-amx":
        return NUMERICS[name] + "; prompt rows bf16 x bf16 on AMX"
    return NUMERICS.get(name, "-")


def phases(slo_ttft: float, slo_tpot: float) -> dict[str, list[str]]:
    """"workload c=N" -> `pdserve bench` flags; a seed per point, so no point reuses another's prompts."""
    out = {}
    for w, (flags, points) in WORKLOADS.items():
        for c, n in points.items():
            seed = 1000 + 100 * len(out)
            out[f"{w} c={c}"] = [*flags, "--max-concurrency", str(c), "--seed", str(seed), "--temperature", "0.7",
                                 "--slo-ttft", str(slo_ttft), "--slo-tpot", str(slo_tpot),
                                 *(["--num-requests", str(n)] if n else [])]
    return out
PREFIX_PHASE = ["--workload", "shared-prefix", "--num-groups", "8", "--prompts-per-group", "6",
                "--system-prompt-len", "768", "--question-len", "32", "--output-len", "8", "--max-concurrency", "4"]
QUICK = {"prompt-heavy c=1": ["--max-concurrency", "1", "--num-requests", "2", "--input-len", "32",
                               "--output-len", "8"]}


def systems(args, port: int) -> dict[str, tuple[list[str], dict] | None]:
    """name -> (command line, extra environment); None: not installed here."""
    py = [sys.executable, "-m", "pdserve"]
    common = ["--kv-cache-memory", args.kv_cache_memory, "--quantization", args.quantization]
    out: dict[str, tuple[list[str], dict] | None] = {
        # the README's main command, no flags but the port and the KV size every system gets
        "pdserve": (py + ["up", "--port", str(port), *common], {}),
        "pdserve-aggregated": (py + ["up", "--port", str(port), "--mode", "aggregated", *common], {}),
        # weight-only int8 (perplexity +0.5%): the fast single-stream configuration
        "pdserve-aggregated-int8": (py + ["up", "--port", str(port), "--mode", "aggregated", "--kv-cache-memory",
                                          args.kv_cache_memory, "--quantization", "int8"], {}),
        # the same with the reference model's math: fp32 activations on the dequantized weights
        "pdserve-exact": (py + ["up", "--port", str(port), "--kv-cache-memory", args.kv_cache_memory,
                                "--quantization", "exact"], {}),
        # the main command with the kernels forced to their AVX2 build: on a CPU with more (AVX-512
        # VNNI), the before/after of the per-CPU kernels in one run
        "pdserve-avx2": (py + ["up", "--port", str(port), *common], {ISA_ENV: "avx2"}),
        # on a CPU with AMX: the main command without the AMX build (prompt rows on W4A8 too)
        "pdserve-vnni": (py + ["up", "--port", str(port), *common], {ISA_ENV: "avx512-vnni"}),
        # the main command with a smaller KV cache per token: where KV reads bound a batch step
        "pdserve-kv-bf16": (py + ["up", "--port", str(port), *common, "--kv-cache-dtype", "bf16"], {}),
        "pdserve-kv-fp32": (py + ["up", "--port", str(port), *common, "--kv-cache-dtype", "fp32"], {}),
        "pdserve-kv-int8": (py + ["up", "--port", str(port), *common, "--kv-cache-dtype", "int8"], {}),
        "transformers": (py + ["baseline-server", "--port", str(port), "--max-batch", "32"], {}),
        "llama.cpp": None, "vllm": None, "vllm-bf16": None, "vllm-fp32": None,
    }
    from pdserve.engine.model.weights import default_model_path
    server = llama_peer.command(port, default_model_path(), len(os.sched_getaffinity(0)))
    if server:
        out["llama.cpp"] = (server, {})
    elif importlib.util.find_spec("llama_cpp") is not None:
        out["llama.cpp"] = ([sys.executable, "-m", "llama_cpp.server", "--model", str(default_model_path()),
                             "--port", str(port), "--n_threads", str(os.cpu_count() or 1), "--n_ctx", "4096",
                             # by default a new request cancels the one in flight: queue them instead
                             "--interrupt_requests", "False"], {})
    venv = Path(args.vllm_venv)
    for name, dtype in (("vllm", vllm_peer.best_dtype()), ("vllm-bf16", "bfloat16"), ("vllm-fp32", "float32")):
        cmd = vllm_peer.command(port, dtype, venv, Path(args.vllm_model))
        if cmd:
            out[name] = (cmd, vllm_peer.environment(venv))
    return out


class Server:
    """One system under test, started here and stopped by its own PID."""

    def __init__(self, name: str, cmd: list[str], port: int, log_dir: Path, env: dict | None = None):
        self.name, self.cmd, self.url = name, cmd, f"http://127.0.0.1:{port}"
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{name}.log"
        env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled", PYTHONWARNINGS="ignore",
                   **(env or {}))
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
        """SIGINT, then SIGKILL after 60 s; then the files its ended processes left (bench/procs.py)."""
        tree = {self.proc.pid} | descendants(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        clear_leftovers(tree)


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


def headline(merged: dict, ready: dict, roof: dict | None = None) -> dict:
    """Per system: each load point's figures (what the tables of docs/performance.md show)."""
    out = {}
    for name in ready:
        points, failed, short = {}, 0, 0
        for phase, slot in merged.items():
            ep = ((slot.get("results") or {}).get("endpoints") or {}).get(name)
            if not ep or not ep["runs"]:
                continue
            m = ep["runs"][0]["metrics"]
            points[phase] = {"output_tok_s": m["output_throughput"], "ttft_p50_ms": m["ttft_ms"]["p50"],
                             "tpot_p50_ms": m["tpot_ms"]["p50"], "itl_p50_ms": m["itl_ms"]["p50"],
                             "goodput_req_s": m["goodput"], "request_s": m["request_throughput"]}
            if roof:
                points[phase]["roof_fraction"] = roof_fraction(m, roof)
            failed += m.get("failed", 0)
            # requests that ended before their max_tokens (a server ignoring ignore_eos):
            # their throughput is not comparable and the table says so
            short += m.get("output_len_mismatches", 0)
        out[name] = {"numerics": numerics(name), "ready_s": ready[name], "failed": failed, "short_outputs": short, "points": points}
    return out


def reference(head: dict) -> str:
    """The system ratios are taken against: vLLM where it ran, else the transformers baseline."""
    return next((n for n in ("vllm", "vllm-fp32", "vllm-bf16", "transformers") if n in head), "")


def markdown(head: dict, prefix: dict | None) -> str:
    ref = reference(head)
    phases = list(dict.fromkeys(p for h in head.values() for p in h["points"]))
    lines = ["| system | numerics | ready (s) | failed |", "|---|---|---|---|"]
    for name, h in head.items():
        short = f" ({h['short_outputs']} outputs shorter than asked)" if h.get("short_outputs") else ""
        lines.append(f"| {name}{short} | {h.get('numerics', '-')} | {h['ready_s']:.0f} | {h['failed']} |")
    lines += ["", "| load point | system | out tok/s | TTFT p50 (ms) | TPOT p50 (ms) | ITL p50 (ms) | goodput (req/s) "
              "| of the fp32 roof |", "|---|---|---|---|---|---|---|---|"]
    for phase in phases:
        base = head.get(ref, {}).get("points", {}).get(phase, {})
        for name, h in head.items():
            m = h["points"].get(phase)
            if not m:
                continue
            ratio = lambda k: (f" ({m[k] / base[k]:.2f}x)" if name != ref and base.get(k) else "")
            lines.append(f"| {phase} | {name} | {m['output_tok_s']:.1f}{ratio('output_tok_s')} | "
                         f"{m['ttft_p50_ms']:.0f}{ratio('ttft_p50_ms')} | {m['tpot_p50_ms']:.0f} | "
                         f"{m['itl_p50_ms']:.0f} | {m['goodput_req_s']:.2f} | "
                         + (f"{m['roof_fraction']:.0%} |" if "roof_fraction" in m else "- |"))
    if ref:
        lines.append(f"\n(x): ratio to {ref} in the same run; higher is better for tok/s, lower for TTFT.")
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
    p.add_argument("--systems", default="vllm,llama.cpp,pdserve,pdserve-exact,pdserve-aggregated,transformers",
                   help="systems to compare, in order (missing ones are skipped) (default: %(default)s)")
    p.add_argument("--port", type=int, default=8300, help="port each system serves on in turn")
    p.add_argument("--kv-cache-memory", default="1GiB", help="pdserve's KV cache per worker (default: %(default)s)")
    p.add_argument("--quantization", default="auto", choices=QUANTIZATIONS, help="pdserve's weights (default: the product default)")
    p.add_argument("--prefix-routing", action="store_true", help="also compare prefix-aware and round-robin routing")
    p.add_argument("--vllm-venv", default=str(vllm_peer.VENV), help="vLLM's own venv (`make vllm`) (default: %(default)s)")
    p.add_argument("--vllm-model", default=str(vllm_peer.MODEL_DIR),
                   help="the model as a Hugging Face directory (`pdserve export-hf`) (default: %(default)s)")
    p.add_argument("--slo-ttft", type=float, default=5.0, help="goodput: TTFT at most this many s (default: %(default)s)")
    p.add_argument("--slo-tpot", type=float, default=0.2, help="goodput: TPOT at most this many s (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="one tiny phase per system (a smoke test)")
    p.add_argument("--points", default="", help='only these load points, e.g. "decode-heavy c=32,prompt-heavy c=1"')
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds per system to start (vLLM compiles)")
    p.add_argument("--output", default="bench/peers-results.json")
    p.add_argument("--plot-dir", default="bench/plots/peers", help="PNG plots per phase ('' for none)")
    p.set_defaults(func=cmd_bench_peers)


def prefix_routing(args, out_dir: Path, log) -> dict:
    """TTFT of a shared-prefix workload through 2 prefill workers, per routing policy."""
    py = [sys.executable, "-m", "pdserve", "up", "--port", str(args.port), "--prefill", "2",
          "--kv-cache-memory", "160MiB", "--quantization", args.quantization,
          # every prompt through the prefill pool: this compares its routing
          "--decode-local-prefill", "0", "--prefill-queue-limit", "0"]
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


def compute_roof() -> dict:
    """The machine's measured GEMM rate (fp32, 1024x1024, every core; bf16 too where the CPU
    has bf16 instructions) and the model's FLOPs per token, for the fraction of the compute
    roof each load point reaches."""
    import torch

    from pdserve.engine.kernels.native import cpu_flags
    from pdserve.engine.model.weights import default_model_path, load_state_dict

    def rate(dtype) -> float:
        m = torch.randn(1024, 1024).to(dtype)
        m @ m
        best = min(_timed(lambda: [m @ m for _ in range(10)]) for _ in range(5)) / 10
        return 2 * 1024**3 / best / 1e9

    cfg = load_state_dict(default_model_path())[1]
    L, h, kv, hd, d = (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                       cfg.hidden_size)
    layer_params = L * (d * (h + 2 * kv) * hd + h * hd * d + 3 * d * cfg.intermediate_size)
    out = {"gemm_gflops_fp32": rate(torch.float32), "threads": torch.get_num_threads(),
           "flops_per_prompt_token": 2 * layer_params,  # the LM head runs for sampled rows only
           "flops_per_output_token": 2 * (layer_params + cfg.vocab_size * d)}
    if bf16_native(cpu_flags()):
        out["gemm_gflops_bf16"] = rate(torch.bfloat16)
    return out


# oneDNN's instruction-set caps (ONEDNN_MAX_CPU_ISA) under which its bf16 matmuls are emulated
_NO_BF16_CAPS = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"}


def bf16_native(flags: set[str]) -> bool:
    """Whether torch's bf16 matmuls run on bf16 instructions here: the CPU has them and oneDNN is
    not capped below them (`ONEDNN_MAX_CPU_ISA` or `DNNL_MAX_CPU_ISA`, as when a run forces the
    AVX2 paths on an AVX-512 CPU: an emulated bf16 GEMM then costs minutes and measures nothing)."""
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").strip().upper()
    return bool({"avx512_bf16", "amx_bf16"} & flags) and cap not in _NO_BF16_CAPS


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def roof_fraction(metrics: dict, roof: dict) -> float:
    """Linear-layer FLOPs of a load point's tokens over its duration, as a fraction of the fp32
    GEMM rate (attention is left out: a few % at these lengths)."""
    flops = (metrics["input_tokens"] * roof["flops_per_prompt_token"]
             + metrics["output_tokens"] * roof["flops_per_output_token"])
    return flops / metrics["duration_s"] / (roof["gemm_gflops_fp32"] * 1e9)


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
    plan = QUICK if args.quick else phases(args.slo_ttft, args.slo_tpot)
    if args.points:
        points = [x.strip() for x in args.points.split(",")]
        unknown = [x for x in points if x not in plan]
        if unknown:
            raise SystemExit(f"unknown load point(s) {unknown}: choose from {list(plan)}")
        plan = {k: v for k, v in plan.items() if k in points}
    merged, ready, skipped = {}, {}, {}
    for name in wanted:
        if cmds[name] is None:
            skipped[name] = "not installed"
            log(f"{name}: not installed, skipped")
            continue
        cmd, env = cmds[name]
        srv = Server(name, cmd, args.port, out_dir / "logs", env)
        try:
            ready[name] = srv.wait_ready(args.ready_timeout)
            log(f"{name}: ready in {ready[name]:.1f}s")
            run_phases(name, srv.url, plan, out_dir, merged)
        except (RuntimeError, TimeoutError) as e:
            skipped[name] = str(e)
            log(f"{name}: {e}")
        finally:
            srv.stop()
    prefix = prefix_routing(args, out_dir, log) if args.prefix_routing and not args.quick else None
    roof = compute_roof()
    head = headline(merged, ready, roof)
    table = markdown(head, prefix)
    result = {"headline": head, "reference": reference(head), "prefix_routing": prefix, "skipped": skipped,
              "markdown": table, "cpu": cpu_description(), "roof": roof,
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
