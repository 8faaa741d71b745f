"""`pdserve bench-cluster`: disaggregated vs aggregated serving in one run.

1. A mixed workload against each mode started with `pdserve up` (real processes: Ray actors,
   gRPC, HTTP): short-prompt streams decode continuously while long prompts keep arriving.
   Reported: the decoders' inter-token latency (ITL) p50/p99 and the long prompts' time to
   first token (TTFT) p50/p99.
2. KV transfer throughput for a 1k-token request's blocks: gRPC (loopback) vs in-process
   vs a plain memory copy.
3. The hand-off's share of TTFT for a 1k-token prompt: prefill compute vs export + push +
   import of its KV.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch


def add_bench_cluster_args(p) -> None:
    p.add_argument("--streams", type=int, default=4, help="background decode streams")
    p.add_argument("--stream-tokens", type=int, default=160, help="tokens each background stream generates")
    p.add_argument("--long-prompts", type=int, default=6, help="long prompts sent while the streams decode")
    p.add_argument("--long-len", type=int, default=1024, help="tokens per long prompt")
    p.add_argument("--long-interval", type=float, default=2.0, help="seconds between long prompts")
    p.add_argument("--output", default="bench/results/cluster.json")
    p.set_defaults(func=cmd_bench_cluster)


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))] if xs else float("nan")


async def _stream(client, url, body, on_token):
    async with client.stream("POST", url + "/v1/completions", json=body | {"stream": True}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0]["text"]:
                    on_token(time.perf_counter())


async def mixed_workload(url: str, model: str, args, vocab_words: list[str]) -> dict:
    rng = random.Random(0)
    itl, ttft, idle_itl = [], [], []
    async with httpx.AsyncClient(timeout=300) as client:
        async def decoder(i, sink):
            stamps = []
            await _stream(client, url, {"model": model, "prompt": f"Story {i}: Once upon a time", "temperature": 0,
                                        "max_tokens": args.stream_tokens, "ignore_eos": True}, stamps.append)
            sink.extend(b - a for a, b in zip(stamps, stamps[1:]))

        async def long_prompt(k):
            await asyncio.sleep(1.0 + k * args.long_interval)
            words = " ".join(rng.choice(vocab_words) for _ in range(args.long_len))
            t0, first = time.perf_counter(), []
            await _stream(client, url, {"model": model, "prompt": f"{k} {words}", "max_tokens": 4, "temperature": 0,
                                        "ignore_eos": True}, lambda t: first.append(t))
            ttft.append(first[0] - t0)

        await asyncio.gather(*(decoder(i, idle_itl) for i in range(args.streams)))  # idle: decode only
        await asyncio.gather(*(decoder(i, itl) for i in range(args.streams)),
                             *(long_prompt(k) for k in range(args.long_prompts)))
    return {"itl_idle_p50_ms": 1e3 * pct(idle_itl, 50), "itl_idle_p99_ms": 1e3 * pct(idle_itl, 99),
            "itl_p50_ms": 1e3 * pct(itl, 50), "itl_p99_ms": 1e3 * pct(itl, 99),
            "ttft_long_p50_ms": 1e3 * pct(ttft, 50), "ttft_long_p99_ms": 1e3 * pct(ttft, 99),
            "long_prompts": len(ttft)}


def run_mode(mode_args: list[str], args, vocab_words) -> dict:
    from pdserve.registry.embedded import free_port

    port = free_port()
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")
    proc = subprocess.Popen([sys.executable, "-m", "pdserve", "up", "--port", str(port), "--kv-cache-memory",
                             "256MiB", *mode_args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        if not proc.stdout.readline().startswith("curl "):
            raise RuntimeError(f"pdserve up {' '.join(mode_args)} did not start")
        url = f"http://127.0.0.1:{port}"
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        return asyncio.run(mixed_workload(url, model, args, vocab_words))
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)


def transfer_bench(n_tokens: int = 1024, repeats: int = 5) -> dict:
    from pdserve.engine.model.tiny import tiny_config  # noqa: F401 (keeps import cost out of the timings below)
    from pdserve.kv_transfer.grpc_transport import GrpcKVSender, GrpcKVServer
    from pdserve.kv_transfer.local import LocalKVSender
    from pdserve.kv_transfer.receiver import KVReceiver

    layout = (30, 2, 16, 3, 64)  # SmolLM2-135M's KV blocks
    n_blocks = n_tokens // 16
    kv = torch.randn(layout[0], 2, n_blocks, *layout[2:])
    nbytes = kv.numel() * kv.element_size()

    async def main():
        rx = KVReceiver("fp", layout)
        server = GrpcKVServer(rx)
        addr = await server.start()
        grpc_s, local_s = GrpcKVSender("bench"), LocalKVSender({"d": rx})
        times = {"grpc": [], "local": []}
        for i in range(repeats):
            for name, sender, target in (("grpc", grpc_s, addr), ("local", local_s, "d")):
                rx.expect(f"r{i}{name}", list(range(n_blocks)), n_tokens, 60)
                t = time.perf_counter()
                await sender.push(target, f"r{i}{name}", kv, dest_block_ids=list(range(n_blocks)), num_tokens=n_tokens,
                                  first_token=1, model_fingerprint="fp", timeout_s=60)
                times[name].append(time.perf_counter() - t)
                rx.take_ready()
        await grpc_s.close()
        await server.stop()
        return times

    times = asyncio.run(main())
    copy = [_timed(lambda: kv.clone()) for _ in range(repeats)]
    return {"tokens": n_tokens, "bytes": nbytes,
            "grpc_gb_s": nbytes / statistics.median(times["grpc"]) / 1e9,
            "local_gb_s": nbytes / statistics.median(times["local"]) / 1e9,
            "memcpy_gb_s": nbytes / statistics.median(copy) / 1e9}


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def handoff_bench(n_tokens: int = 1024, repeats: int = 3) -> dict:
    """Prefill compute vs the hand-off (export, gRPC push, import) for one prompt."""
    from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from pdserve.engine.core.engine import LLMEngine
    from pdserve.common.sampling_params import SamplingParams
    from pdserve.engine.model.weights import load_model
    from pdserve.kv_transfer.grpc_transport import GrpcKVSender, GrpcKVServer
    from pdserve.kv_transfer.receiver import KVReceiver

    loaded = load_model()
    cfg = EngineConfig(cache=CacheConfig(kv_cache_memory=256 << 20, enable_prefix_caching=False),
                       scheduler=SchedulerConfig(max_num_batched_tokens=n_tokens))
    prefill, decode = LLMEngine(loaded, cfg), LLMEngine(loaded, cfg)
    rng = random.Random(1)
    compute, handoff = [], []

    async def main():
        rx = KVReceiver(loaded.fingerprint, decode.kv_cache.layout)
        server = GrpcKVServer(rx)
        addr = await server.start()
        sender = GrpcKVSender("bench")
        for i in range(repeats):
            prompt = [rng.randrange(100, 40000) for _ in range(n_tokens)]
            rid = f"h{i}"
            t0 = time.perf_counter()
            prefill.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0), hold_kv=True)
            first = [o for o in prefill.step()][0].new_token_ids[0]
            t1 = time.perf_counter()
            dest = decode.add_remote_request(rid, prompt, SamplingParams(max_tokens=2, temperature=0))
            rx.expect(rid, dest, n_tokens, 60)
            tokens, kv = prefill.export_kv(rid)
            prefill.release_kv(rid)
            await sender.push(addr, rid, kv, dest_block_ids=dest, num_tokens=len(tokens), first_token=first,
                              model_fingerprint=loaded.fingerprint, timeout_s=60)
            decode.import_kv(rid, rx.take(rid).kv, first)
            t2 = time.perf_counter()
            decode.abort(rid)
            compute.append(t1 - t0)
            handoff.append(t2 - t1)
        await sender.close()
        await server.stop()

    asyncio.run(main())
    c, h = statistics.median(compute), statistics.median(handoff)
    return {"tokens": n_tokens, "prefill_ms": 1e3 * c, "handoff_ms": 1e3 * h, "handoff_share_of_ttft": h / (c + h)}


def cmd_bench_cluster(args) -> int:
    from pdserve.common.tokenizer import Tokenizer
    from pdserve.engine.model.weights import default_model_path

    log = lambda *a: print(*a, file=sys.stderr, flush=True)
    tok = Tokenizer.from_model_path(default_model_path())
    words = [w for w in (tok.decode([i]).strip() for i in range(1000, 6000)) if w.isalpha() and len(w) > 3]
    result = {"settings": {k: v for k, v in vars(args).items() if k != "func"}}
    result["kv_transfer"] = transfer_bench()
    log("KV transfer, 1k tokens ({:.0f} MB): gRPC {grpc_gb_s:.2f} GB/s | in-process {local_gb_s:.0f} GB/s | "
        "memcpy {memcpy_gb_s:.2f} GB/s".format(result["kv_transfer"]["bytes"] / 1e6, **result["kv_transfer"]))
    result["handoff"] = handoff_bench()
    log("hand-off, 1k-token prompt: prefill {prefill_ms:.0f} ms + hand-off {handoff_ms:.0f} ms "
        "({handoff_share_of_ttft:.1%} of TTFT)".format(**result["handoff"]))
    modes = {"disaggregated": ["--prefill", "1", "--decode", "1"],
             "aggregated": ["--mode", "aggregated", "--decode", "1", "--decode-cpus", "2"]}
    for name, mode_args in modes.items():
        r = result[name] = run_mode(mode_args, args, words)
        log(f"{name:14s} ITL idle p50/p99 {r['itl_idle_p50_ms']:.0f}/{r['itl_idle_p99_ms']:.0f} ms | "
            f"under long prompts p50/p99 {r['itl_p50_ms']:.0f}/{r['itl_p99_ms']:.0f} ms | "
            f"long-prompt TTFT p50/p99 {r['ttft_long_p50_ms']:.0f}/{r['ttft_long_p99_ms']:.0f} ms")
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    log(f"wrote {out}")
    return 0
