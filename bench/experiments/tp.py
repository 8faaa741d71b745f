"""Tensor parallelism on this machine, in one run: SmolLM2 (9 heads, 3 KV heads) at TP=1 and
TP=3 (three processes on this host, their collectives in shared memory): prefill time of a 512-token prompt, decode step time
at 1 and 8 rows, the all-reduce time per step (two per layer and the vocabulary-parallel
embedding lookup, 61 per step), the gather of each rank's logits per step, and the KV re-shard
of a hand-off (export of a 1k-token prompt's KV: gathered from the ranks into the whole
model's layout; import: split over them), each against TP=1 (2 threads); at TP=3 every rank
has one thread. The machine has 2 cores, so TP=3 shows the overhead, not a speed-up. 3 interleaved repeats, medians. Writes
bench/experiments/tp-results.json.

    . .venv/bin/activate && python bench/experiments/tp.py
"""
import json
import statistics
import subprocess
import time
from pathlib import Path

import torch

from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.core.engine import LLMEngine
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.parallel.tp import ModelSource
from pdserve.engine.model.weights import load_model

CFG = EngineConfig(cache=CacheConfig(kv_cache_memory=256 << 20))


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def measure(e: LLMEngine) -> dict:
    r: dict = {}
    g = e.tp.group if e.tp else None
    e.add_request("p", list(range(100, 612)), SamplingParams(max_tokens=1, temperature=0))
    r["prefill_512_s"] = timed(lambda: [e.step() for _ in range(2) if e.has_unfinished_requests()])
    for rows in (1, 8):
        for i in range(rows):
            e.add_request(f"d{rows}-{i}", list(range(200 + i, 264 + i)), SamplingParams(max_tokens=40,
                                                                                        temperature=0, ignore_eos=True))
        while any(r_.num_computed_tokens < r_.num_prompt_tokens for r_ in e.scheduler.running) or e.scheduler.waiting:
            e.step()
        before = (g.allreduce_s, g.allreduces, g.gather_s) if g else (0.0, 0, 0.0)
        steps = [timed(e.step) for _ in range(20)]
        r[f"decode_step_{rows}_s"] = statistics.median(steps)
        if g:
            r[f"allreduce_per_step_{rows}_s"] = (g.allreduce_s - before[0]) / 20
            r["allreduces_per_step"] = (g.allreduces - before[1]) / 20
            r[f"logits_gather_per_step_{rows}_s"] = (g.gather_s - before[2]) / 20
        e.abort_all()
    prompt = list(range(300, 1324))
    e.add_request("x", prompt, SamplingParams(max_tokens=1, temperature=0), hold_kv=True)
    while e.has_unfinished_requests():
        e.step()
    r["kv_export_1k_s"] = timed(lambda: e.export_kv("x"))
    _, kv = e.export_kv("x")
    e.release_kv("x")
    e.add_remote_request("y", prompt, SamplingParams(max_tokens=2, temperature=0))
    r["kv_import_1k_s"] = timed(lambda: e.import_kv("y", kv, 5))
    r["kv_bytes_1k"] = kv.numel() * kv.element_size()
    r["embedding_rows_rank0"] = e.runner.model.model.embed_tokens.weight.shape[0]
    e.abort_all()
    return r


def main() -> None:
    loaded = load_model()
    runs: dict = {1: [], 3: []}
    for _ in range(3):
        for tp in (1, 3):
            # each rank one thread at TP=3 (2 cores, 3 processes); TP=1 keeps both cores
            torch.set_num_threads(2 if tp == 1 else 1)
            e = LLMEngine(loaded, CFG) if tp == 1 else LLMEngine.tensor_parallel(ModelSource(), CFG, tp)
            try:
                runs[tp].append(measure(e))
            finally:
                e.shutdown()
            print(tp, runs[tp][-1], flush=True)
    med = {tp: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for tp, rs in runs.items()}
    out = {"cpu": subprocess.run(["lscpu"], capture_output=True, text=True).stdout.split("\n")[:20],
           "tp1": med[1], "tp3": med[3], "ratio_tp3_over_tp1": {k: med[3][k] / med[1][k] for k in med[1]}}
    Path(__file__).with_name("tp-results.json").write_text(json.dumps(out, indent=1))
    print(json.dumps({k: out[k] for k in ("tp1", "tp3", "ratio_tp3_over_tp1")}, indent=1))


if __name__ == "__main__":
    main()
