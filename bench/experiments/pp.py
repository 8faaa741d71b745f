"""Pipeline parallelism on this machine, in one run: SmolLM2 (30 layers) as one engine (2
threads) and as PP=2 (two processes of one thread each, gloo between them): `pp2` the default
split (engine/parallel/degrees.py `split_layers`: 15 layers on stage 0, which also runs the LM
head, sampling and scheduling, 15 on stage 1), `pp2_13_17` 13 and 17 (the default before the
nineteenth session), both with micro-batches in
flight (engine/core/micro_batches.py), and `pp2_one_step` the default split one step at a time;
decode-heavy: 1 and 32 streams of 64-token prompts and 64 tokens out, each stream's prompt
new. Reports tokens/s (prompt + output over the run's wall time, and output alone), the decode
step time (with micro-batches: the time of an engine step, which lands one micro-batch), and
the pipe's bubble: the share of rank 0's time spent waiting for the last stage
(engine/parallel/pp.py `Stage.idle_s`; with one micro-batch in the pipe, every stage waits
while the others compute). The machine has 2 cores: PP=2 shows what the pipe costs, not
a speed-up. 3 interleaved repeats, medians. First, what the default split weighs
(`stage0_extra`): one engine of one thread at 16 streams (a micro-batch of 32), the layers
without the one-call C step as a stage runs them, the time of its steps beyond the model's
forward pass (the LM head, sampling, scheduling) in layers' time, beside `head_weight`, the
split's estimate from the model's shapes. Writes bench/experiments/pp-results.json.

    . .venv/bin/activate && python bench/experiments/pp.py
"""
import json
import statistics
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import torch

from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.core.engine import LLMEngine
from pdserve.engine.model.weights import load_model
from pdserve.engine.parallel.pp import head_weight, split_layers
from pdserve.engine.parallel.tp import ModelSource

CFG = EngineConfig(cache=CacheConfig(kv_cache_memory=256 << 20))
OUT = 64


def run(e: LLMEngine, streams: int, seed: int) -> dict:
    """`streams` requests at once to the end; tokens/s and, under PP, rank 0's idle share."""
    stage = getattr(e.runner.model, "pp", None)
    idle0 = stage.idle_s if stage else 0.0
    for i in range(streams):
        base = 1000 + ((seed * 97 + i) * 64) % 40000  # distinct first ids: no prefix is shared
        e.add_request(f"s{seed}-{i}", list(range(base, base + 64)),
                      SamplingParams(max_tokens=OUT, temperature=0, ignore_eos=True))
    steps, t0 = [], time.perf_counter()
    while e.has_unfinished_requests():
        t = time.perf_counter()
        e.step()
        steps.append(time.perf_counter() - t)
    wall = time.perf_counter() - t0
    r = {"tokens_per_s": streams * (64 + OUT) / wall, "output_tokens_per_s": streams * OUT / wall,
         "decode_step_s": statistics.median(steps[-OUT // 2:])}
    if stage:
        r["bubble"] = (stage.idle_s - idle0) / wall
    assert e.blocks.num_used_blocks == 0
    return r


def stage0_extra(loaded, streams: int = 16) -> float:
    """Median over 3 runs of one engine's (one thread) step time beyond its forward pass, in
    layers' time (the forward pass over the layers)."""
    from pdserve.engine.model import native_step
    torch.set_num_threads(1)
    e, forward, usable = LLMEngine(loaded, CFG), type(loaded.model).forward, native_step.usable
    spent = [0.0]

    def timed(self, *a, **k):
        t = time.perf_counter()
        out = forward(self, *a, **k)
        spent[0] += time.perf_counter() - t
        return out
    type(loaded.model).forward, native_step.usable = timed, lambda *a, **k: False  # each layer, as a stage runs it
    try:
        ws = []
        for rep in range(3):
            spent[0], t = 0.0, time.perf_counter()
            run(e, streams, 100 + rep)
            wall = time.perf_counter() - t
            ws.append((wall - spent[0]) / (spent[0] / loaded.config.num_hidden_layers))
        return statistics.median(ws)
    finally:
        type(loaded.model).forward, native_step.usable = forward, usable
        e.shutdown()


MODES = ("pp1", "pp2_one_step", "pp2", "pp2_13_17")  # pp2_one_step: PP=2 with micro-batching off
SPLITS = {"pp2_13_17": (13, 17)}  # else the default split


def main() -> None:
    loaded = load_model()
    extra = {"stage0_extra_layers": stage0_extra(loaded), "head_weight": head_weight(loaded.config),
             "default_split": split_layers(loaded.config, 2)}
    print(extra, flush=True)
    runs: dict = {(m, n): [] for m in MODES for n in (1, 32)}
    for rep in range(3):
        for m in MODES:
            torch.set_num_threads(2 if m == "pp1" else 1)  # 2 cores: one thread a stage at PP=2
            cfg = replace(CFG, pipeline_layers=SPLITS.get(m, ()))
            e = LLMEngine(loaded, CFG) if m == "pp1" else \
                LLMEngine.tensor_parallel(ModelSource(), cfg, 2, pipeline=True)
            if m == "pp2_one_step":
                e.micro_batches = None
            try:
                for n in (1, 32):
                    runs[(m, n)].append(run(e, n, rep * 10 + n))
                    print(m, n, runs[(m, n)][-1], flush=True)
            finally:
                e.shutdown()
    med = {f"{m}_{n}": {k: statistics.median(x[k] for x in rs) for k in rs[0]} for (m, n), rs in runs.items()}
    out = {"cpu": subprocess.run(["lscpu"], capture_output=True, text=True).stdout.split("\n")[:20], **extra, **med,
           **{f"{m}_over_pp1_tokens_per_s": {n: med[f"{m}_{n}"]["tokens_per_s"] / med[f"pp1_{n}"]["tokens_per_s"]
                                             for n in (1, 32)} for m in MODES[1:]}}
    Path(__file__).with_name("pp-results.json").write_text(json.dumps(out, indent=1))
    print(json.dumps({k: v for k, v in out.items() if k != "cpu"}, indent=1))


if __name__ == "__main__":
    main()
