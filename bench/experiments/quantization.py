"""Weight quantization (`--quantization`): quality against fp32 and decode speed, same run.

Quality: perplexity on a fixed text (bench/data/perplexity.txt, 512-token windows, prompt
logprobs through the engine) and greedy agreement on a prompt set (identical outputs, and the
mean share of tokens generated before the first divergence). Speed: pure-decode steps at batch
1 and 32, repeats interleaved across the variants, medians. Writes bench/experiments/quantization-results.json.

    . .venv/bin/activate && python bench/experiments/quantization.py
"""
import json
import statistics
import time
from pathlib import Path

from pdserve.bench.engine import bench_pdserve_decode
from pdserve.bench.quality import PROMPTS, agreement, perplexity
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.core.engine import LLMEngine
from pdserve.engine.model.quant import FBGEMM_CPU_NEEDS, fbgemm_cpu_problem
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.tokenizer import Tokenizer
from pdserve.engine.model.weights import load_model

HERE = Path(__file__).resolve().parent
# "none" first (the fp32 reference); fbgemm modes only where this CPU runs them right
VARIANTS = tuple(q for q in ("none", "auto", "int8", "q4_1", "fp16", "w8a8")
                 if q not in FBGEMM_CPU_NEEDS or not fbgemm_cpu_problem(q))
def main() -> None:
    tok = None
    engines, load_s = {}, {}
    for q in VARIANTS:
        t = time.perf_counter()
        loaded = load_model(quantization=q)
        load_s[q] = time.perf_counter() - t
        tok = tok or Tokenizer.from_model_path(loaded.path)
        engines[q] = LLMEngine(loaded, EngineConfig(quantization=q, cache=CacheConfig(kv_cache_memory=256 << 20)), tok)
    text = tok.encode((HERE.parent / "data" / "perplexity.txt").read_text())
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in PROMPTS]
    greedy = SamplingParams(max_tokens=48, temperature=0)
    res = {q: {"load_s": load_s[q]} for q in VARIANTS}
    outs = {}
    for q, e in engines.items():
        res[q]["perplexity"] = perplexity(e, text)
        outs[q] = e.generate(prompts, greedy)
        res[q]["greedy_vs_fp32"] = agreement(outs["none"], outs[q])
        alone = [e.generate([p], greedy)[0] for p in prompts[:4]]
        res[q]["batch_invariant"] = alone == outs[q][:4]
        print(f"{q:5s} perplexity {res[q]['perplexity']:.3f} ({len(text)} tokens) | greedy vs fp32: "
              f"{res[q]['greedy_vs_fp32']['identical']:.0%} identical, {res[q]['greedy_vs_fp32']['mean_prefix_share']:.0%} "
              f"of tokens before divergence | alone == batched: {res[q]['batch_invariant']}", flush=True)
    for B in (1, 8, 32):
        for q in VARIANTS:
            bench_pdserve_decode(engines[q], B, 64, 8, seed=99)  # warm this shape
        runs = {q: [] for q in VARIANTS}
        for s in range(3):
            for q in VARIANTS:
                runs[q].append(bench_pdserve_decode(engines[q], B, 64, 48, seed=s))
        for q in VARIANTS:
            res[q][f"decode_tok_s_b{B}"] = statistics.median(runs[q])
        print(f"batch {B:2d}: " + " | ".join(f"{q} {res[q][f'decode_tok_s_b{B}']:6.1f} tok/s "
                                              f"(x{res[q][f'decode_tok_s_b{B}'] / res['none'][f'decode_tok_s_b{B}']:.2f})"
                                              for q in VARIANTS), flush=True)
    for e in engines.values():
        assert e.blocks.num_used_blocks == 0, "KV blocks leaked"
    HERE.joinpath("quantization-results.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
