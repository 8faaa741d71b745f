"""Microbenchmark: the matmuls of one SmolLM2-135M decode step, fp32 oneDNN vs the native
weight-only kernels (engine/kernels/native: int8 per-row, Q4_1 groups of 32).

One "step" = 30 layers x [qkv (960,576), o (576,576), gate+up (3072,576), down (576,1536)]
+ the LM head (49152,576), every matrix with its OWN weights (540 MB in fp32, so nothing is
served from the 32 MB L3 the way a single repeated matrix would be). Each step runs every
matrix in sequence at M rows; best of --repeats, with the kernels interleaved per repeat so a
noisy neighbour hits them alike. GB/s = weight bytes read per step / time (int8: 1 B/weight
+ scales; Q4_1: 0.5 B/weight + 8 B per group of 32). Writes bench/experiments/native-kernels-results.json.

    .venv/bin/python bench/experiments/native_kernels.py [--repeats 5] [--ms 1,4,8,16,32]
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from pdserve.engine.kernels import native

HERE = Path(__file__).resolve().parent
LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
SHAPES = LAYER * 30 + [(49152, 576)]
KERNELS = ("fp32 oneDNN", "int8 C", "q4_1 C")


def build_weights(seed: int = 0):
    """Per matrix: the oneDNN-packed fp32 copy, int8 (q, scales), Q4_1 (packed, d, m)."""
    g = torch.Generator().manual_seed(seed)
    packed, i8, q4 = [], [], []
    for n, k in SHAPES:
        w = torch.randn(n, k, generator=g) * 0.02
        packed.append(torch.ops.mkldnn._reorder_linear_weight(w, 32))
        i8.append(native.quantize_int8(w))
        q4.append(native.quantize_q4_1(w))
    return packed, i8, q4


def step_fns(packed, i8, q4):
    lin = torch.ops.mkldnn._linear_pointwise

    def fp32(xs):
        for (_, k), p in zip(SHAPES, packed):
            lin(xs[k], p, None, "none", [], "")

    def int8(xs):
        f = native.int8_matmul
        for (_, k), (q, s) in zip(SHAPES, i8):
            f(xs[k], q, s)

    def q4_1(xs):
        f = native.q4_1_matmul
        for (_, k), (p, d, m) in zip(SHAPES, q4):
            f(xs[k], p, d, m)

    return dict(zip(KERNELS, (fp32, int8, q4_1)))


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for ts in tensors for t in ts)


def call_overhead_us(repeats: int = 2000) -> float:
    """Python + ctypes + allocation cost of one int8_matmul call on a tiny (8, 32) weight."""
    q, s = native.quantize_int8(torch.randn(8, 32))
    x = torch.randn(1, 32)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(repeats):
            native.int8_matmul(x, q, s)
        best = min(best, (time.perf_counter() - t) / repeats)
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--ms", default="1,4,8,16,32")
    ap.add_argument("--output", default=str(HERE / "native-kernels-results.json"))
    args = ap.parse_args()
    ms = [int(v) for v in args.ms.split(",")]

    lib = native.load()  # compile outside the timed region
    isa = "avx2" if lib.woq_has_avx2() else "scalar"
    t0 = time.perf_counter()
    packed, i8, q4 = build_weights()
    print(f"built {len(SHAPES)} matrices in {time.perf_counter() - t0:.1f} s; threads={torch.get_num_threads()}, "
          f"native kernels: {isa}; oneDNN ISA: {torch.backends.cpu.get_cpu_capability()}")
    elems = sum(n * k for n, k in SHAPES)
    weight_bytes = {"fp32 oneDNN": 4 * elems, "int8 C": nbytes(i8), "q4_1 C": nbytes(q4)}
    fns = step_fns(packed, i8, q4)

    results = []
    for m in ms:
        xs = {k: torch.randn(m, k) for k in (576, 1536)}
        for f in fns.values():  # warm-up: thread pools, page faults
            f(xs)
        best = dict.fromkeys(KERNELS, float("inf"))
        for _ in range(args.repeats):
            for name, f in fns.items():
                t = time.perf_counter()
                f(xs)
                best[name] = min(best[name], time.perf_counter() - t)
        for name in KERNELS:
            results.append({"m": m, "kernel": name, "ms": round(best[name] * 1e3, 3),
                            "gb_per_s": round(weight_bytes[name] / best[name] / 1e9, 1)})
        print(f"M={m:<3} " + "  ".join(f"{k} {best[k] * 1e3:7.2f} ms" for k in KERNELS), flush=True)

    # a table: ms per step (GB/s), and the fp32/int8 ratio
    print(f"\n| M | {' | '.join(KERNELS)} | fp32 / int8 | fp32 / q4_1 |")
    print("|---|" + "---|" * (len(KERNELS) + 2))
    by = {(r["m"], r["kernel"]): r for r in results}
    for m in ms:
        cells = [f"{by[m, k]['ms']:.2f} ms ({by[m, k]['gb_per_s']:.0f} GB/s)" for k in KERNELS]
        fp = by[m, "fp32 oneDNN"]["ms"]
        print(f"| {m} | {' | '.join(cells)} | {fp / by[m, 'int8 C']['ms']:.2f}x | {fp / by[m, 'q4_1 C']['ms']:.2f}x |")
    slower = {k: [m for m in ms if by[m, k]["ms"] > by[m, "fp32 oneDNN"]["ms"]] for k in ("int8 C", "q4_1 C")}
    crossover = {k: (v[0] if v else None) for k, v in slower.items()}
    overhead = call_overhead_us()
    print(f"\nfirst M where fp32 oneDNN is faster: {crossover}; per-call overhead {overhead:.1f} us "
          f"x {len(SHAPES)} calls/step")

    out = {"shapes": "SmolLM2-135M decode step: 30 x [(960,576),(576,576),(3072,576),(576,1536)] + (49152,576)",
           "weight_bytes": weight_bytes, "repeats": args.repeats, "threads": torch.get_num_threads(),
           "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
           "native_isa": isa, "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
           "results": results, "fp32_faster_from_m": crossover, "call_overhead_us": round(overhead, 2)}
    Path(args.output).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
