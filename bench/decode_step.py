"""The decode step against the weight-streaming roof: the default model ("auto": Q4_1 layer
weights on W4A8, int8 activations per 16, fp32 or bf16 KV), a decode-only step of 1, 4, 8 and 32
rows at a realistic context, by the Python layer loop ("old") and the one C call over all
layers (engine/kernels/native/step.c, "native"); and one stream's inter-token latency
through LLMEngine.step, old vs native (--itl-tokens 0: not measured).

The roof: the bytes of weights the layers read per step (the packed W4A8 matrices and the
norms: each is read once a step whatever the rows) over the read bandwidth measured in the
same run (a sum over a 256 MB tensor on the process's threads, median); the fraction is roof
time / measured time. The K/V the attention reads is reported beside it.

    python -m pdserve.bench.decode_step [--rows 1,4,8,32] [--context 256] [--repeats 15]
        [--kv-cache-dtype fp32|bf16] [--threads N] [--itl-tokens 48]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

OUT = Path(__file__).with_name("decode-step-results.json")


def read_bandwidth(repeats: int = 7) -> float:
    """Bytes per second a sum over a 256 MB fp32 tensor reads (median of `repeats`)."""
    big = torch.ones(64 << 20)
    big.sum()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        big.sum()
        ts.append(time.perf_counter() - t)
    return big.numel() * 4 / statistics.median(ts)


def weight_bytes(model, nibbles: bool) -> int:
    """Bytes of weights the decoder layers (and the final norm) read per step: the native
    step's nibble-packed matrices with their fp16 scales where it has them (`nibbles`), or the
    Python path's one byte per weight and fp32 scales."""
    total = model.model.norm.weight.numel() * 4
    for layer, lw in zip(model.model.layers, model.native_decode.layers):
        total += 4 * (lw.input_norm.numel() + lw.post_norm.numel())
        for lin, packed, half in zip((layer.self_attn.qkv_linear, layer.self_attn.o_linear, layer.mlp.gate_up_linear,
                                      layer.mlp.down_linear), (lw.qkv, lw.o, lw.gate_up, lw.down),
                                     lw.half or (None,) * 4):
            read = (packed if half is None else (packed[0], half)) if nibbles else lin.packed
            total += sum(t.numel() * t.element_size() for t in read)
    return total


def _step_inputs(cfg, rows: int, ctx: int, bs: int = 16, kv_dtype: torch.dtype = torch.float32):
    """A decode-only step of `rows` requests at `ctx` tokens (the new one included) over a
    cache of random K/V in `kv_dtype`."""
    from pdserve.engine.kernels.attention import AttentionMetadata
    per = (ctx + bs - 1) // bs
    kv = (torch.randn(cfg.num_hidden_layers, 2, 1 + rows * per, bs, cfg.num_key_value_heads, cfg.head_dim) * 0.5
          ).to(kv_dtype)
    layers = [(kv[i, 0], kv[i, 1]) for i in range(cfg.num_hidden_layers)]
    tables = torch.arange(1, 1 + rows * per).view(rows, per)
    slots = tables[:, (ctx - 1) // bs] * bs + (ctx - 1) % bs
    lens = torch.full((rows,), ctx)
    ids = torch.randint(100, 10000, (rows,))
    meta = lambda: AttentionMetadata(slots, rows, tables, lens, [], bs)  # noqa: E731 (fresh per step: backend_state)
    return ids, lens - 1, layers, meta


def step_times(model, rows: int, ctx: int, repeats: int, kv_dtype: torch.dtype = torch.float32) -> dict:
    """Median and best ms of one step (backend.prepare + forward) by each path: the Python
    loop, the C step as the engine runs it ("native": one OpenMP team up to 4 rows, the rows
    split between the threads above), on one team at every row count, and with a region per
    op; the paths alternate in rounds so a noisy neighbour weighs on all alike."""
    ids, pos, layers, meta = _step_inputs(model.config, rows, ctx, kv_dtype=kv_dtype)
    native_decode = model.native_decode
    times = {"old": [], "native": [], "native_team": [], "native_per_op": []}
    try:
        with torch.inference_mode():
            for r in range(repeats + 2):
                for name in times:
                    model.native_decode = None if name == "old" else native_decode
                    native_decode.one_region = name != "native_per_op"
                    native_decode.team_rows = rows if name == "native_team" else 4
                    m = meta()
                    t = time.perf_counter()
                    model.backend.prepare(m)
                    model(ids, pos, layers, m)
                    if r >= 2:  # the first rounds warm up
                        times[name].append(time.perf_counter() - t)
    finally:
        model.native_decode, native_decode.one_region, native_decode.team_rows = native_decode, True, 4
    return {**{name: statistics.median(ts) * 1e3 for name, ts in times.items()},
            **{f"{name}_best": min(ts) * 1e3 for name, ts in times.items()}}


def engine_itl(loaded, tok, native_on: bool, tokens: int, prompt_len: int = 64, kv_cache_dtype: str = "auto") -> float:
    """Median ms between one stream's tokens through LLMEngine.step (greedy, after the first)."""
    from pdserve.common.sampling_params import SamplingParams
    from pdserve.engine.config import CacheConfig, EngineConfig
    from pdserve.engine.core.engine import LLMEngine
    eng = LLMEngine(loaded, EngineConfig(cache=CacheConfig(kv_cache_memory=32 << 20, kv_cache_dtype=kv_cache_dtype)),
                    tok)
    if not native_on:
        loaded.model.native_decode = None
    prompt = torch.randint(100, 10000, (prompt_len,), generator=torch.Generator().manual_seed(1)).tolist()
    eng.add_request("itl", prompt, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    stamps = []
    while eng.has_unfinished_requests():
        if any(o.new_token_ids for o in eng.step()):
            stamps.append(time.perf_counter())
    loaded.model.use_native_ops(True)
    gaps = [b - a for a, b in zip(stamps[1:], stamps[2:])]  # from the second decode step on
    return statistics.median(gaps) * 1e3


def head_times(model, rows: list[int], repeats: int, bw: float) -> dict:
    """The LM head per row count: "auto"'s int16-activation kernel against the fp32-activation
    kernel the same Q8_0 weights ran on before (ms, median), and its fraction of the read roof."""
    from pdserve.engine.model.quant import make_linear
    w = model.lm_head.weight.data
    auto, fp32_act = make_linear(w, "auto"), make_linear(w, "exact")
    head_bytes = w.shape[0] * w.shape[1] * (1 + 4 / 32)  # int8 weights and an fp32 scale per 32
    out = {}
    for m in rows:
        x = torch.randn(m, w.shape[1])
        t = {}
        for name, lin in (("int16_act", auto), ("fp32_act", fp32_act)):
            lin(x)
            t[name] = statistics.median(_timed(lambda: lin(x)) for _ in range(repeats)) * 1e3  # noqa: B023
        out[str(m)] = {**{f"{k}_ms": round(v, 3) for k, v in t.items()},
                       "roof_fraction_int16_act": round(head_bytes / bw * 1e3 / t["int16_act"], 3)}
        print(f"{m:3d} rows: LM head int16 activations {t['int16_act']:.2f} ms, fp32 activations "
              f"{t['fp32_act']:.2f} ms", flush=True)
    return out


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def run(rows: list[int], ctx: int, repeats: int, itl_tokens: int, kv_cache_dtype: str = "fp32") -> dict:
    from pdserve.bench.metrics import cpu_description
    from pdserve.common.tokenizer import Tokenizer
    from pdserve.engine.kernels.attention import NativeAttentionBackend
    from pdserve.engine.model.weights import load_model

    kv_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[kv_cache_dtype]
    load_before = os.getloadavg()
    loaded = load_model(quantization="auto")
    model, cfg = loaded.model, loaded.config
    model.backend = NativeAttentionBackend()
    model.use_native_ops(True)
    if model.native_decode is None:
        raise SystemExit("the native step does not cover this model here (no AVX2 or no W4A8 weights)")
    nib_bytes, byte_bytes, bw = weight_bytes(model, True), weight_bytes(model, False), read_bandwidth()
    roof = {"native": nib_bytes / bw * 1e3, "old": byte_bytes / bw * 1e3}  # ms
    kv_per_row = ctx * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * kv_dtype.itemsize
    per_rows = {}
    for m in rows:
        t = step_times(model, m, ctx, repeats, kv_dtype)
        kv_ms = m * kv_per_row / bw * 1e3
        per_rows[str(m)] = {**{f"{k}_ms": round(v, 3) for k, v in t.items()},
                            "speedup": round(t["old"] / t["native"], 2), "kv_bytes_read": m * kv_per_row,
                            **{f"roof_fraction_{p}": round(roof[p] / t[p], 3) for p in ("old", "native")},
                            "roof_fraction_native_with_kv": round((roof["native"] + kv_ms) / t["native"], 3)}
        print(f"{m:3d} rows: old {t['old']:.2f} ms, native {t['native']:.2f} ms; fraction of the roof: native "
              f"{roof['native'] / t['native']:.2f}, old {roof['old'] / t['old']:.2f}", flush=True)
    head = head_times(model, rows, repeats, bw)
    tok = Tokenizer.from_model_path(loaded.path)
    itl = {name: round(statistics.median(engine_itl(loaded, tok, on, itl_tokens, kv_cache_dtype=kv_cache_dtype)
                                         for _ in range(3)), 3)
           for name, on in (("old", False), ("native", True))} if itl_tokens else {}
    if itl:
        print(f"engine ITL at one stream: old {itl['old']:.2f} ms, native {itl['native']:.2f} ms", flush=True)
    return {"cpu": cpu_description(), "threads": torch.get_num_threads(),
            "load_average_1min": {"before": round(load_before[0], 2), "after": round(os.getloadavg()[0], 2)},
            "numerics": f"auto: Q4_1 layer weights on W4A8 (int8 activations per 16), {kv_cache_dtype} KV "
                        "cache, Q8_0 LM head on int16 activations per 32",
            "context_tokens": ctx, "repeats": repeats,
            "weight_bytes_per_step": {"native": nib_bytes, "old": byte_bytes},
            "read_bandwidth_gb_s": round(bw / 1e9, 2), "roof_ms": {p: round(v, 3) for p, v in roof.items()},
            "roof_note": "weight bytes per step / read bandwidth: the native step reads nibble-packed weights "
                         "(0.5 byte each plus scales), the Python path w4a8.c's one byte each",
            "step_ms_by_rows": per_rows, "lm_head_ms_by_rows": head, "engine_itl_ms_one_stream": itl,
            "engine_itl_note": f"median gap between tokens over {itl_tokens} greedy tokens after a 64-token "
                               "prompt, LM head and sampling included; median of 3 runs"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,4,8,32")
    p.add_argument("--context", type=int, default=256, help="tokens in each row's context")
    p.add_argument("--repeats", type=int, default=15, help="timed steps per path and row count (median)")
    p.add_argument("--itl-tokens", type=int, default=48, help="tokens of the engine ITL run; 0: no ITL run")
    p.add_argument("--kv-cache-dtype", choices=("fp32", "bf16"), default="fp32", help="the step's KV cache")
    p.add_argument("--threads", type=int, default=0, help="torch (and so the kernels') threads; 0: torch's default")
    p.add_argument("--output", default=str(OUT))
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    result = run([int(r) for r in a.rows.split(",")], a.context, a.repeats, a.itl_tokens, a.kv_cache_dtype)
    Path(a.output).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {a.output}")


if __name__ == "__main__":
    main()
