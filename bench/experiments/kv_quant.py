"""KV cache formats (`--kv-cache-dtype`, `--kv-wire-dtype`): quality, capacity, decode speed
and the prompt hand-off, one run, on the default model with the default weights.

Quality: on the fixed text (bench/data/perplexity.txt, 512-token windows, teacher-forced),
the perplexity and how often the top-1 next token equals the model-dtype cache's ("auto",
fp32); greedy generations on a prompt set against auto's, with the default weights (int8
activations) and with fp32 weights (the cache's own effect, without activation rounding). Capacity: blocks
and tokens in 1 GiB. Speed: pure-decode steps at 1, 8 and 32 streams after 256-token prompts,
repeats interleaved across formats, medians. Hand-off: TTFT of 1k and 4k-token prompts through
a real prefill worker and decode worker (gRPC on loopback, one process, both engines sharing
this machine's cores), the KV bytes each push carried and the time spent pushing. Writes
bench/experiments/kv-quant-results.json.

    . .venv/bin/activate && python bench/experiments/kv_quant.py
"""
import asyncio
import json
import math
import platform
import statistics
import subprocess
import time
from pathlib import Path


from pdserve.bench.engine import bench_pdserve_decode
from pdserve.bench.quality import PROMPTS, agreement
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.kv_transfer.config import TransferConfig
from pdserve.engine.core.engine import LLMEngine
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.tokenizer import Tokenizer
from pdserve.engine.model.weights import load_model

HERE = Path(__file__).resolve().parent
FORMATS = ("auto", "bf16", "fp8", "int8")
# (cache on both pools, what the prefill worker sends): the last row is wire-only compression
HANDOFFS = (("auto", "auto"), ("bf16", "auto"), ("fp8", "auto"), ("int8", "auto"), ("auto", "int8"))


def cpu_name() -> str:
    """lscpu's model name and family, and which of the vector extensions that matter here it has."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor()
    info = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = info.get("Flags", "").split()
    have = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni") if f in flags]
    return (f"{info.get('Model name', '?').strip()} (family {info.get('CPU family', '?').strip()}, model "
            f"{info.get('Model', '?').strip()}), {info.get('CPU(s)', '?').strip()} CPUs, {' '.join(have)}")


def text_pass(engine, ids: list[int], window: int = 512) -> tuple[float, list[int]]:
    """Perplexity of `ids` and the top-1 prediction at every position, teacher-forced."""
    nll, top1 = 0.0, []
    for i, start in enumerate(range(0, len(ids) - 1, window)):
        chunk = ids[start:start + window]
        if len(chunk) < 2:
            break
        engine.add_request(f"text-{i}", chunk, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
        while engine.has_unfinished_requests():
            for out in engine.step():
                for lp in out.prompt_logprobs or []:
                    nll -= lp.logprob
                    top1.append(lp.top[0][0])
    return math.exp(nll / len(top1)), top1


def fp32_weights_quality(text, prompts, greedy) -> dict:
    """With fp32 weights and activations (the cache's own effect, no activation rounding):
    each format's perplexity, top-1 agreement and greedy generations against auto's."""
    loaded = load_model(quantization="none")
    res, top1, outs = {}, {}, {}
    for k in FORMATS:
        e = LLMEngine(loaded, EngineConfig(quantization="none", cache=CacheConfig(kv_cache_dtype=k,
                                                                                  kv_cache_memory=256 << 20)))
        ppl, top1[k] = text_pass(e, text)
        outs[k] = e.generate(prompts, greedy)
        res[k] = {"perplexity": ppl, "top1_vs_auto": statistics.mean(a == b for a, b in zip(top1["auto"], top1[k])),
                  "greedy_vs_auto": agreement(outs["auto"], outs[k])}
    return res


def quality_and_speed(loaded, tok) -> dict:
    engines = {k: LLMEngine(loaded, EngineConfig(cache=CacheConfig(kv_cache_dtype=k, kv_cache_memory=1 << 30)), tok)
               for k in FORMATS}
    text = tok.encode((HERE.parent / "data" / "perplexity.txt").read_text())
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in PROMPTS]
    greedy = SamplingParams(max_tokens=48, temperature=0)
    res, outs, top1 = {}, {}, {}
    fp32_weights = fp32_weights_quality(text, prompts, greedy)
    for k, e in engines.items():
        ppl, top1[k] = text_pass(e, text)
        res[k] = {"blocks_per_GiB": e.kv_cache.num_blocks, "tokens_per_GiB": e.kv_cache.num_blocks * e.kv_cache.block_size,
                  "bytes_per_token": e.kv_cache.bytes_per_block // e.kv_cache.block_size, "perplexity": ppl,
                  "top1_vs_auto": statistics.mean(a == b for a, b in zip(top1["auto"], top1[k]))}
        outs[k] = e.generate(prompts, greedy)
        res[k]["greedy_vs_auto"] = agreement(outs["auto"], outs[k])
        res[k]["fp32_weights"] = fp32_weights[k]
        print(f"{k:5s} {res[k]['bytes_per_token']:6d} B/token, {res[k]['tokens_per_GiB']:7d} tokens/GiB | perplexity "
              f"{ppl:.4f}, top-1 = auto's at {res[k]['top1_vs_auto']:.2%} of {len(top1[k])} positions | greedy vs auto: "
              f"{res[k]['greedy_vs_auto']['identical']:.0%} identical, {res[k]['greedy_vs_auto']['mean_prefix_share']:.0%} "
              f"before divergence | fp32 weights: perplexity {fp32_weights[k]['perplexity']:.4f}, top-1 "
              f"{fp32_weights[k]['top1_vs_auto']:.2%}, greedy {fp32_weights[k]['greedy_vs_auto']['identical']:.0%} "
              f"identical, {fp32_weights[k]['greedy_vs_auto']['mean_prefix_share']:.0%}", flush=True)
    for B in (1, 8, 32):
        for k in FORMATS:
            bench_pdserve_decode(engines[k], B, 256, 4, seed=99)  # warm this shape
        runs = {k: [] for k in FORMATS}
        for s in range(3):
            for k in FORMATS:
                runs[k].append(bench_pdserve_decode(engines[k], B, 256, 32, seed=s))
        for k in FORMATS:
            res[k][f"decode_tok_s_{B}"] = statistics.median(runs[k])
        print(f"{B:2d} streams: " + " | ".join(f"{k} {res[k][f'decode_tok_s_{B}']:6.1f} tok/s "
                                               f"(x{res[k][f'decode_tok_s_{B}'] / res['auto'][f'decode_tok_s_{B}']:.2f})"
                                               for k in FORMATS), flush=True)
    for e in engines.values():
        assert e.blocks.num_used_blocks == 0, "KV blocks leaked"
    return res


async def _ttft(prefill, decode, rid: str, prompt: list[int]) -> float:
    import grpc

    from pdserve.protos import worker_pb2 as pb
    from pdserve.protos import worker_pb2_grpc as pb_grpc
    from pdserve.protos.convert import params_to_proto

    async with grpc.aio.insecure_channel(decode.address) as ch:
        t = time.perf_counter()
        call = pb_grpc.DecodeServiceStub(ch).Generate(pb.GenerateRequest(
            request_id=rid, prompt_token_ids=prompt, prefill_address=prefill.address,
            params=params_to_proto(SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))))
        async for msg in call:
            assert msg.prefilled_remotely
            return time.perf_counter() - t


def handoffs(loaded, sizes=(1024, 4096), repeats=2) -> dict:
    from pdserve.decode_worker.service import DecodeWorker
    from pdserve.engine.core.async_engine import AsyncEngine
    from pdserve.kv_transfer.senders import SchemeKVSender
    from pdserve.prefill_worker.service import PrefillWorker

    def engine(kv):
        return AsyncEngine(LLMEngine(loaded, EngineConfig(cache=CacheConfig(kv_cache_dtype=kv, kv_cache_memory=512 << 20))))

    async def run():
        pairs = {(kv, wire): (PrefillWorker(engine(kv), SchemeKVSender(f"p-{kv}-{wire}"), f"p-{kv}-{wire}",
                                            transfer=TransferConfig(wire_dtype=wire)), DecodeWorker(engine(kv), f"d-{kv}-{wire}"))
                 for kv, wire in HANDOFFS}
        for p, d in pairs.values():
            await p.start()
            await d.start()
        out = {}
        try:
            for j, n in enumerate(sizes):
                times = {key: [] for key in pairs}
                for r in range(repeats + (j == 0)):  # interleaved; a first round warms every pair up
                    for key, (p, d) in pairs.items():
                        prompt = [(r * 7919 + n * 31 + i * 104729) % 40000 + 100 for i in range(n)]
                        before = (p.kv_bytes, p.kv_seconds)
                        ttft = await _ttft(p, d, f"h{n}-{r}-{key}", prompt)
                        if r or j:
                            times[key].append((ttft, p.kv_bytes - before[0], p.kv_seconds - before[1]))
                for (kv, wire), got in times.items():
                    name = f"{kv}" + (f" (wire {wire})" if wire != "auto" else "")
                    out.setdefault(name, {})[n] = {"ttft_s": statistics.median(t for t, _, _ in got),
                                                   "kv_bytes": got[-1][1],
                                                   "push_s": statistics.median(s for _, _, s in got)}
                    row = out[name][n]
                    print(f"{n:5d}-token hand-off, {name:18s}: TTFT {row['ttft_s']:.3f} s, {row['kv_bytes'] / 1e6:6.1f} MB "
                          f"pushed in {row['push_s'] * 1e3:6.1f} ms", flush=True)
        finally:
            for p, d in pairs.values():
                await d.stop()
                await p.stop()
            for p, d in pairs.values():
                assert p.engine.engine.blocks.num_used_blocks == 0 and d.engine.engine.blocks.num_used_blocks == 0
        return out
    return asyncio.run(run())


def main() -> None:
    loaded = load_model(quantization=EngineConfig().quantization)
    tok = Tokenizer.from_model_path(loaded.path)
    res = {"cpu": cpu_name(), "model": loaded.path.name, "weights": EngineConfig().quantization}
    print(f"CPU: {res['cpu']}", flush=True)
    res["formats"] = quality_and_speed(loaded, tok)
    res["handoff"] = handoffs(loaded)
    HERE.joinpath("kv-quant-results.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
