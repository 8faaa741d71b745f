"""Prompt-lookup speculative decoding: greedy single-stream decode speed with and without it
on tasks whose output copies the input (code edit, quoting) and on free text, same engine,
interleaved repeats, medians; outputs must be identical. Writes bench/experiments/speculative-results.json.

    . .venv/bin/activate && python bench/experiments/speculative.py
"""
import json
import statistics
import time
from pathlib import Path

from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.core.engine import LLMEngine
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.tokenizer import Tokenizer
from pdserve.engine.model.weights import load_model

loaded = load_model(); tok = Tokenizer.from_model_path(loaded.path)
text = (Path(__file__).resolve().parents[2] / "engine" / "speculative.py").read_text()[:1500]
tasks = {
 "code edit": f"Here is a Python file:\n{text}\nRewrite it exactly as it is, without changes.",
 "quote summary": "The report says: 'Revenue grew 12% to 4.1 billion dollars, driven by cloud services, while operating costs fell 3%.' Quote the report's sentence exactly, then summarize it.",
 "free chat": "Write a short poem about autumn leaves.",
}
res = {}
for name, content in tasks.items():
    p = tok.encode(tok.apply_chat_template([{"role": "user", "content": content}]))
    params = SamplingParams(max_tokens=128, temperature=0)
    r = {}
    for spec in (0, 5, 0, 5, 0, 5):
        e = LLMEngine(loaded, EngineConfig(speculative_tokens=spec, cache=CacheConfig(kv_cache_memory=128 << 20)), tok)
        e.generate([p], SamplingParams(max_tokens=2, temperature=0))  # warm
        t = time.perf_counter(); out = e.generate([p], params)[0]; dt = time.perf_counter() - t
        r.setdefault(spec, []).append((len(out) / dt, out, (e.speculator.accepted, e.speculator.proposed) if spec else None))
    base = statistics.median(x[0] for x in r[0]); sp = statistics.median(x[0] for x in r[5])
    same = r[0][0][1] == r[5][0][1]
    acc = r[5][-1][2]
    res[name] = (base, sp, sp / base, same, acc, len(r[0][0][1]))
    print(f"{name:14s} greedy {base:6.1f} tok/s, prompt-lookup k=5 {sp:6.1f} tok/s: x{sp/base:.2f}; identical={same}; accepted {acc[0]}/{acc[1]} guesses; {len(r[0][0][1])} tokens")
Path(__file__).with_name("speculative-results.json").write_text(json.dumps(
    {k: {"greedy_tok_s": v[0], "speculative_tok_s": v[1], "speedup": v[2], "identical": v[3],
         "accepted": v[4][0], "proposed": v[4][1], "tokens": v[5]} for k, v in res.items()}, indent=1))
