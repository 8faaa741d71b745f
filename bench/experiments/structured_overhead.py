"""What structured output adds to a decode step: the same batch decoded with and without a
grammar constraint (a JSON schema whose one string field lets every request run the whole
budget), repeats interleaved, medians reported. Writes bench/experiments/structured-results.json.

    . .venv/bin/activate && python bench/experiments/structured_overhead.py
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

SCHEMA = {"type": "object", "properties": {"story": {"type": "string", "minLength": 400, "maxLength": 800}},
          "required": ["story"], "additionalProperties": False}
STEPS = 48


def step_times(engine, prompts, params) -> list[float]:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", p, params)
    times = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return times[1:]  # the first step is the prefill


def main() -> None:
    from pdserve.engine.config import CacheConfig, EngineConfig
    from pdserve.engine.core.engine import LLMEngine
    from pdserve.common.sampling_params import SamplingParams
    from pdserve.common.structured import Structured
    from pdserve.common.tokenizer import Tokenizer
    from pdserve.engine.model.weights import load_model

    loaded = load_model()
    tok = Tokenizer.from_model_path(loaded.path)
    engine = LLMEngine(loaded, EngineConfig(cache=CacheConfig(kv_cache_memory=256 << 20)), tok)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Write a long story as JSON."}]))
    free = SamplingParams(max_tokens=STEPS, temperature=0.8, seed=1, ignore_eos=True)
    constrained = SamplingParams(max_tokens=STEPS, temperature=0.8, seed=1, ignore_eos=True,
                                 structured=Structured("json_schema", json.dumps(SCHEMA)))
    results = {}
    for batch in (1, 8, 32):
        runs = {"free": [], "json_schema": []}
        for _ in range(3):  # interleaved: the machine is shared
            for name, params in (("free", free), ("json_schema", constrained)):
                runs[name].append(statistics.median(step_times(engine, [prompt] * batch, params)))
        f, c = statistics.median(runs["free"]) * 1e3, statistics.median(runs["json_schema"]) * 1e3
        results[f"batch{batch}"] = {"step_ms_free": f, "step_ms_json_schema": c, "added_ms_per_step": c - f,
                                    "added_ms_per_request_per_step": (c - f) / batch, "ratio": c / f}
        print(f"batch {batch:3d}: decode step {f:6.1f} ms free, {c:6.1f} ms constrained: +{c - f:5.2f} ms "
              f"({(c - f) / batch:.3f} ms per constrained request, x{c / f:.3f})")
    out = Path(__file__).with_name("structured-results.json")
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
