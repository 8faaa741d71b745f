"""`python -m pdserve.bench.lora`: what LoRA adapters cost the engine, in one run.

Decode throughput of one batch of `--batch` requests on the default model (SmolLM2) served
- by the base model alone (the baseline, on the default kernels: the one-call C decode step);
- with every request under one adapter, and with the batch's requests spread round-robin over
  4 and over 16 resident adapters (requests of several adapters in the same steps);
and the cost of loading an adapter (reading and checking its files, fusing its matrices) at
each rank. Adapters are written here in PEFT's format (adapter_config.json +
adapter_model.safetensors, random non-zero A and B on all seven projections), as
`PeftModel.save_pretrained` would, so the benchmark needs no peft. Writes
bench/lora-results.json with the CPU it ran on.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.config import CacheConfig, EngineConfig, LoRAConfig
from pdserve.engine.core.engine import LLMEngine
from pdserve.engine.model.lora import CONFIG_FILE, SECTION, WEIGHTS_FILE, projection_shapes

from .metrics import cpu_description

HERE = Path(__file__).resolve().parent


def write_adapter(path: Path, cfg, rank: int, seed: int) -> Path:
    """A PEFT LoRA adapter for a model of `cfg` at `rank` on every projection of every layer."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for proj, (out, inp) in projection_shapes(cfg).items():
            key = f"base_model.model.model.layers.{layer}.{SECTION[proj]}.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, inp, generator=g) * inp ** -0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.01
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / WEIGHTS_FILE))
    (path / CONFIG_FILE).write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                "target_modules": sorted(SECTION), "bias": "none"}))
    return path


def decode_rate(engine: LLMEngine, batch: int, prompt_len: int, tokens: int, loras: list[str | None],
                seed: int) -> dict:
    """Decode tok/s of one batch (steps where every request decodes), request i under
    loras[i % len(loras)]; fresh random prompts (no prefix reuse between runs)."""
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"s{seed}-{i}", [rng.randrange(100, 40000) for _ in range(prompt_len)], params,
                           lora=loras[i % len(loras)])
    decode_s, decode_tokens = 0.0, 0
    while engine.has_unfinished_requests():
        prefilling = any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) or \
            bool(engine.scheduler.waiting)
        t = time.perf_counter()
        outs = engine.step()
        if not prefilling:
            decode_s += time.perf_counter() - t
            decode_tokens += sum(1 for o in outs if o.new_token_ids)
    assert engine.blocks.num_used_blocks == 0, "KV blocks leaked"
    return {"tok_s": decode_tokens / decode_s if decode_s else 0.0, "decode_tokens": decode_tokens}


def load_cost(engine: LLMEngine, root: Path, ranks: list[int], repeats: int) -> dict:
    """Median seconds to load (and unload) an adapter of each rank."""
    out = {}
    for rank in ranks:
        path = write_adapter(root / f"load-r{rank}", engine.loaded.config, rank, seed=1000 + rank)
        times = []
        for i in range(repeats):
            t = time.perf_counter()
            engine.load_lora(f"load-r{rank}-{i}", str(path))
            times.append(time.perf_counter() - t)
            engine.unload_lora(f"load-r{rank}-{i}")
        out[str(rank)] = {"seconds_p50": statistics.median(times),
                          "bytes": (path / WEIGHTS_FILE).stat().st_size}
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--mixes", default="0,1,4,16", help="adapters spread over the batch (0: the base alone)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--output", default=str(HERE / "lora-results.json"))
    a = p.parse_args(argv)
    mixes = [int(m) for m in a.mixes.split(",")]
    most = max(mixes)
    cfg = EngineConfig(cache=CacheConfig(kv_cache_memory=256 << 20),
                       lora=LoRAConfig(max_loras=max(most, 1) + 1, max_lora_rank=max(a.rank, 64)))
    engine = LLMEngine.from_config(cfg)
    res = {"cpu": cpu_description(), "threads": torch.get_num_threads(), "batch": a.batch, "rank": a.rank,
           "prompt_len": a.prompt_len, "tokens": a.tokens, "quantization": cfg.quantization, "runs": {}}
    with tempfile.TemporaryDirectory(prefix="pdserve-lora-bench-") as tmp:
        for i in range(most):
            engine.load_lora(f"a{i}", str(write_adapter(Path(tmp) / f"a{i}", engine.loaded.config, a.rank, seed=i)))
        decode_rate(engine, 2, 16, 4, [None, "a0"], seed=-1)  # warm both paths
        seed = 0
        for rep in range(a.repeats):  # interleaved: each repeat runs every mix, so drift hits all alike
            for m in mixes:
                seed += 1
                loras = [None] if m == 0 else [f"a{i}" for i in range(m)]
                r = decode_rate(engine, a.batch, a.prompt_len, a.tokens, loras, seed)
                res["runs"].setdefault(str(m), []).append(r["tok_s"])
                print(f"repeat {rep} adapters {m:2d}: {r['tok_s']:.1f} tok/s", flush=True)
        res["decode_tok_s_p50"] = {m: statistics.median(v) for m, v in res["runs"].items()}
        base = res["decode_tok_s_p50"]["0"] if "0" in res["decode_tok_s_p50"] else None
        if base:
            res["vs_base"] = {m: v / base for m, v in res["decode_tok_s_p50"].items()}
        res["load_seconds"] = load_cost(engine, Path(tmp), sorted({8, a.rank, 64}), a.repeats)
    Path(a.output).write_text(json.dumps(res, indent=1))
    print(json.dumps({k: res[k] for k in ("decode_tok_s_p50", "vs_base", "load_seconds") if k in res}, indent=1))


if __name__ == "__main__":
    main()
