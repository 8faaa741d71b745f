"""One long prompt's prefill against this CPU's arithmetic peak, measured beside it.

The peak: independent chains of the widest integer multiply-add the kernels' build has (512-bit
`vpdpbusd` with AVX-512 VNNI, 256-bit with AVX-VNNI, `vpmaddubsw` on AVX2) and of fp32 fused
multiply-adds, on the process's threads (engine/kernels/native/peak.c), median of 5. The
prefill: `LLMEngine` with the product's defaults (`auto`: W4A8 matmuls on int8 activations, the
attention in fp32; chunks of `max_num_batched_tokens`), one prompt of `--prompt-len` distinct
tokens (never cached) to its first token, median of `--repeats`. Its multiply-adds: the layers'
matrices for every token (int8) and the causal attention, QK and PV, per head (fp32); the LM
head for the last token. The fraction reported is all of them per second over the int8 peak
(the issue's measure), with each part's share of the work.

    python -m pdserve.bench.prefill_roof [--prompt-len 2048] [--repeats 3] [--output FILE]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time
from pathlib import Path

import torch

OUT = Path(__file__).with_name("prefill-roof-results.json")


def peaks(nt: int, seconds: float = 0.2) -> dict:
    """The int8 and fp32 multiply-adds per second of this CPU on nt threads (median of 5)."""
    from pdserve.engine.kernels import native
    lib = native.load()
    out = {}
    for name, fn in (("int8_gmacs", lib.peak_int8_macs), ("fp32_gfmas", lib.peak_fp32_fmas)):
        fn.restype, fn.argtypes = ctypes.c_int64, [ctypes.c_int64, ctypes.c_int]
        iters = 1 << 16
        while True:  # to about `seconds` a run
            t = time.perf_counter()
            fn(iters, nt)
            if time.perf_counter() - t > seconds / 4:
                break
            iters *= 2
        rates = []
        for _ in range(5):
            t = time.perf_counter()
            n = fn(iters, nt)
            rates.append(n / (time.perf_counter() - t))
        out[name] = round(statistics.median(rates) / 1e9, 1)
    return out


def prefill_macs(cfg, n: int) -> dict:
    """Multiply-adds of one n-token prompt's prefill: the matrices (every token), the causal
    attention (QK and PV, every head), the LM head (the last token)."""
    hd, h, kv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    per_token = cfg.hidden_size * (h + 2 * kv) * hd + h * hd * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size
    return {"matmul": cfg.num_hidden_layers * per_token * n,
            "attention": cfg.num_hidden_layers * h * hd * 2 * n * (n + 1) // 2,
            "lm_head": cfg.vocab_size * cfg.hidden_size}


def prefill_seconds(prompt_len: int, repeats: int) -> tuple[list[float], object]:
    """Seconds from add_request to the first token of `repeats` distinct prompts, and the config."""
    from pdserve.common.sampling_params import SamplingParams
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.core.engine import LLMEngine
    from pdserve.engine.model.weights import load_model
    from pdserve.common.tokenizer import Tokenizer
    loaded = load_model(quantization="auto")
    eng = LLMEngine(loaded, EngineConfig(), Tokenizer.from_model_path(loaded.path))
    g = torch.Generator().manual_seed(7)
    times = []
    for i in range(repeats + 1):  # the first one warms up
        prompt = torch.randint(100, 40000, (prompt_len,), generator=g).tolist()
        eng.add_request(f"p{i}", prompt, SamplingParams(max_tokens=1, temperature=0.0))
        t = time.perf_counter()
        while eng.has_unfinished_requests():
            eng.step()
        if i:
            times.append(time.perf_counter() - t)
    free, total = eng.blocks.num_free_blocks, eng.blocks.num_blocks
    assert free == total, f"{total - free} KV blocks not back after the prefills"
    return times, loaded.config


def run(prompt_len: int, repeats: int) -> dict:
    from pdserve.bench.metrics import cpu_description
    nt = torch.get_num_threads()
    peak = peaks(nt)
    times, cfg = prefill_seconds(prompt_len, repeats)
    macs = prefill_macs(cfg, prompt_len)
    total, t = sum(macs.values()), statistics.median(times)
    return {"cpu": cpu_description(), "threads": nt, "numerics": "auto", "prompt_len": prompt_len,
            "peak": peak, "prefill_s": [round(x, 3) for x in times], "prefill_s_median": round(t, 3),
            "gmacs": {k: round(v / 1e9, 2) for k, v in macs.items()},
            "rate_gmacs": round(total / t / 1e9, 1),
            "fraction_of_int8_peak": round(total / t / 1e9 / peak["int8_gmacs"], 3),
            "attention_share_of_macs": round(macs["attention"] / total, 3)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.prefill_roof", description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3, help="timed prefills (median), after one to warm up")
    p.add_argument("--output", default=str(OUT))
    args = p.parse_args(argv)
    res = run(args.prompt_len, args.repeats)
    Path(args.output).write_text(json.dumps(res, indent=1) + "\n")
    print(f"{args.prompt_len}-token prefill {res['prefill_s_median']} s: {res['rate_gmacs']} G multiply-adds/s, "
          f"{res['fraction_of_int8_peak']:.0%} of the int8 peak ({res['peak']['int8_gmacs']} G/s; fp32 "
          f"{res['peak']['fp32_gfmas']} G/s); attention {res['attention_share_of_macs']:.0%} of the work")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
