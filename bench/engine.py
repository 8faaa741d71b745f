"""`pdserve bench-engine`: decode and prefill throughput of the engine, side by side with a
Hugging Face transformers fp32 baseline on the same weights in the same run, and the
roofline of this machine (measured memory bandwidth and matmul rate).

The baseline is the strongest simple loop a user would write: one batched forward per step
with transformers' own KV cache (DynamicCache), greedy, equal-length prompts (no padding).
Decode throughput counts only steps where every sequence is decoding.
"""
from __future__ import annotations

import json
import platform
import random
import sys
import time
from pathlib import Path

import torch


def add_bench_args(p) -> None:
    p.add_argument("--batch-sizes", default="1,8,32,64")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per sequence in the decode runs")
    p.add_argument("--decode-tokens", type=int, default=64, help="tokens generated per sequence")
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3, help="repeats per measurement; the median is reported")
    p.add_argument("--no-baseline", action="store_true", help="skip the transformers baseline")
    p.add_argument("--output", default="bench/results/engine.json")
    p.set_defaults(func=cmd_bench_engine)


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def _rss_mb() -> dict:
    out = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(("VmHWM", "VmRSS")):
                out[line.split(":")[0]] = int(line.split()[1]) / 1024
    except OSError:
        pass
    return out


def roofline(cfg, batch_sizes, ctx) -> dict:
    """Measured bandwidth and matmul rate, and the tok/s bound they imply per batch size."""
    big = torch.empty(128 << 20, dtype=torch.float32)  # 512 MiB
    dst = torch.empty_like(big)
    dst.copy_(big)
    t = _median([_timed(lambda: dst.copy_(big)) for _ in range(5)])
    bw = 2 * big.numel() * 4 / t  # read + write
    a, b = torch.randn(32, 576), torch.randn(576, 1536 * 2)
    t_small = _median([_timed(lambda: [a @ b for _ in range(50)]) for _ in range(5)]) / 50
    m = torch.randn(1024, 1024)
    t_big = _median([_timed(lambda: m @ m) for _ in range(5)])
    flops_rate = 2 * 1024**3 / t_big
    big = dst = None  # free the 1 GiB before the benchmarks
    L, h, kv, hd = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    layer_params = L * (cfg.hidden_size * (h + 2 * kv) * hd + h * hd * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size)
    head_params = cfg.vocab_size * cfg.hidden_size
    weight_bytes = 4 * (layer_params + head_params)
    per_batch = {}
    for B in batch_sizes:
        kv_bytes = B * ctx * L * 2 * kv * hd * 4
        flops = 2 * B * (layer_params + head_params) + 4 * B * ctx * L * h * hd
        t_mem, t_cmp = (weight_bytes + kv_bytes) / bw, flops / flops_rate
        per_batch[B] = {"bytes_per_step": weight_bytes + kv_bytes, "flops_per_step": flops,
                        "bound": "memory" if t_mem > t_cmp else "compute",
                        "roofline_tok_s": B / max(t_mem, t_cmp)}
    return {"mem_bandwidth_gb_s": bw / 1e9, "matmul_gflops_1024": flops_rate / 1e9,
            "matmul_gflops_decode_shape_b32": 2 * 32 * 576 * 3072 / t_small / 1e9,
            "weight_bytes": weight_bytes, "context_tokens": ctx, "per_batch": per_batch}


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _prompts(n, length, vocab, seed):
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


def bench_pdserve_decode(engine, B, prompt_len, n_tokens, seed) -> float:
    from pdserve.common.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=n_tokens, temperature=0, ignore_eos=True)
    for i, p in enumerate(_prompts(B, prompt_len, engine.model_config.vocab_size, seed)):
        engine.add_request(f"b{B}-{seed}-{i}", p, params)
    tokens, elapsed = 0, 0.0
    while engine.has_unfinished_requests():
        decoding = all(r.num_computed_tokens == r.num_tokens - 1 for r in engine.scheduler.running) \
            and len(engine.scheduler.running) == B
        t = time.perf_counter()
        outs = engine.step()
        if decoding:
            elapsed += time.perf_counter() - t
            tokens += len(outs)
    return tokens / elapsed if elapsed else float("nan")  # nan: too few tokens for a pure-decode step


def bench_pdserve_prefill(engine, length, seed) -> float:
    from pdserve.common.sampling_params import SamplingParams

    engine.add_request(f"pf-{seed}", _prompts(1, length, engine.model_config.vocab_size, seed)[0],
                       SamplingParams(max_tokens=1, temperature=0))
    t = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return length / (time.perf_counter() - t)


def hf_baseline(loaded):
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**loaded.config.to_hf_dict()))
    state = {k: v for k, v in loaded.model.state_dict().items()}
    model.load_state_dict(state, strict=False)
    if loaded.config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


@torch.inference_mode()
def bench_hf_decode(model, vocab, B, prompt_len, n_tokens, seed) -> float:
    from transformers import DynamicCache

    ids = torch.tensor(_prompts(B, prompt_len, vocab, seed))
    cache = DynamicCache()
    out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    t = time.perf_counter()
    for _ in range(n_tokens - 1):
        out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    return B * (n_tokens - 1) / (time.perf_counter() - t)


@torch.inference_mode()
def bench_hf_prefill(model, vocab, length, seed) -> float:
    ids = torch.tensor(_prompts(1, length, vocab, seed))
    t = time.perf_counter()
    model(input_ids=ids, use_cache=True)
    return length / (time.perf_counter() - t)


def cmd_bench_engine(args) -> int:
    from pdserve.engine.core.arg_utils import engine_config
    from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from pdserve.engine.core.engine import LLMEngine

    cfg = engine_config(args)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    t0 = time.perf_counter()
    engine = LLMEngine.from_config(cfg)
    load_s = time.perf_counter() - t0
    mcfg, vocab = engine.model_config, engine.model_config.vocab_size
    result = {"machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                          "torch": torch.__version__}, "model": str(engine.loaded.path), "load_s": load_s,
              "settings": vars(args) | {"func": None}, "pdserve": {}, "transformers": {}}
    log = lambda *a: print(*a, file=sys.stderr, flush=True)
    log(f"engine ready in {load_s:.1f}s: {engine.blocks.num_blocks} KV blocks")
    result["roofline"] = roofline(mcfg, batch_sizes, args.prompt_len + args.decode_tokens // 2)
    log(f"roofline: {result['roofline']['mem_bandwidth_gb_s']:.1f} GB/s, "
        f"{result['roofline']['matmul_gflops_1024']:.0f} GFLOP/s")
    prefill_engine = LLMEngine(engine.loaded, EngineConfig(
        cache=CacheConfig(kv_cache_memory=256 << 20, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_batched_tokens=max(args.prefill_len, 512))), engine.tokenizer)
    # warm-up (oneDNN primitive creation, allocator) at every shape, then this process's peak
    # memory is pdserve's alone: the baseline model is built only after it is read
    for B in batch_sizes:
        bench_pdserve_decode(engine, B, args.prompt_len, 16, seed=99)
    bench_pdserve_prefill(prefill_engine, args.prefill_len, seed=99)
    result["memory_mb"] = _rss_mb() | {"kv_cache": engine.kv_cache.kv.numel() * engine.kv_cache.kv.element_size() / 2**20}
    log(f"pdserve peak RSS {result['memory_mb'].get('VmHWM', 0):.0f} MB "
        f"(KV cache {result['memory_mb']['kv_cache']:.0f} MB)")
    baseline = None
    if not args.no_baseline:
        baseline = hf_baseline(engine.loaded)
        bench_hf_decode(baseline, vocab, 1, args.prompt_len, 4, seed=99)
    # repeats alternate between the two systems so that machine noise hits both alike
    for B in batch_sizes:
        ours, hf = [], []
        for s in range(args.repeats):
            ours.append(bench_pdserve_decode(engine, B, args.prompt_len, args.decode_tokens, s))
            if baseline is not None:
                hf.append(bench_hf_decode(baseline, vocab, B, args.prompt_len, args.decode_tokens, s))
        result["pdserve"][f"decode_tok_s_b{B}"] = _median(ours)
        line = f"decode batch {B:3d}: pdserve {_median(ours):7.1f} tok/s"
        if hf:
            result["transformers"][f"decode_tok_s_b{B}"] = _median(hf)
            line += f" | transformers {_median(hf):7.1f} tok/s | ratio {_median(ours) / _median(hf):.2f}x"
        log(line)
    ours, hf = [], []
    for s in range(args.repeats):
        ours.append(bench_pdserve_prefill(prefill_engine, args.prefill_len, s))
        if baseline is not None:
            hf.append(bench_hf_prefill(baseline, vocab, args.prefill_len, s))
    key = f"prefill_tok_s_{args.prefill_len}"
    result["pdserve"][key] = _median(ours)
    line = f"prefill {args.prefill_len} tokens: pdserve {_median(ours):7.1f} tok/s"
    if hf:
        result["transformers"][key] = _median(hf)
        line += f" | transformers {_median(hf):7.1f} tok/s | ratio {_median(ours) / _median(hf):.2f}x"
    log(line)
    if baseline is not None:
        result["ratios"] = {k: result["pdserve"][k] / result["transformers"][k] for k in result["pdserve"]}
    for B, r in result["roofline"]["per_batch"].items():
        if f"decode_tok_s_b{B}" in result["pdserve"]:
            r["pdserve_fraction_of_roofline"] = result["pdserve"][f"decode_tok_s_b{B}"] / r["roofline_tok_s"]
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str))
    print(json.dumps({"pdserve": result["pdserve"], "transformers": result["transformers"],
                      "ratios": result.get("ratios")}, indent=2))
    log(f"wrote {out}")
    return 0
