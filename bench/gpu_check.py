"""One short script for a machine with a GPU: checks the Triton kernels against the torch path
on CUDA and times paged-attention decode against the torch backend's gather + SDPA for
SmolLM2-shaped caches, in fp16/bf16/fp32 and in the 8-bit KV formats (int8, fp8 e4m3 codes
with a scale per token and head, engine/kv/formats.py; fp16 queries); then tensor parallelism
over 3 ranks on the device (check_tp); the Triton LoRA kernel (engine/kernels/triton_lora.py)
against the torch ops for batches of 1, 4 and 16 adapters (check_lora); the Triton MoE kernel
(engine/kernels/triton_moe.py) against the torch grouping of experts (check_moe). Prints a table and
writes bench/gpu-results.json. A few minutes at most.

    python bench/gpu_check.py [MODEL]    # needs CUDA and triton; without CUDA it says so and skips
                                         # MODEL: the TP check's model (default: the default model)
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch


def timed(fn, repeats: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / repeats


def check_sampler_on_cuda() -> bool:
    """Every per-request logit adjustment (penalties, logit bias, min_tokens) on CUDA logits
    equals the CPU result: a device mix-up there would kill a GPU worker's engine."""
    from pdserve.engine.core.request import Request
    from pdserve.engine.sampling.sampler import apply_penalties
    from pdserve.common.sampling_params import SamplingParams

    params = SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2,
                            logit_bias={5: 3.0, 7: -100.0}, min_tokens=4, stop_token_ids=[9])
    req = Request("r", [1, 2, 3], params, max_tokens=16, eos_token_id=0)
    for t in (2, 5, 5):
        req.append_output(t)
    logits = torch.randn(64)
    ok = torch.allclose(apply_penalties(logits.clone(), req), apply_penalties(logits.clone().cuda(), req).cpu())
    print(f"sampler adjustments on CUDA equal the CPU's: {ok}")
    return ok


def check_tp(model: str = "") -> dict:
    """Tensor parallelism on the GPU (engine/parallel/tp.py): SmolLM2 over 3 ranks sharing the device
    (gloo moves CUDA tensors through the host; NCCL needs one GPU per rank) against 1 rank:
    greedy tokens, decode step time, all-reduce time per step, a KV export (gather) and import
    (scatter) of the whole model's layout. Failures are reported, not raised: this runs where
    no one can watch it."""
    from pdserve.engine.config import CacheConfig, EngineConfig
    from pdserve.engine.core.engine import LLMEngine
    from pdserve.common.sampling_params import SamplingParams
    from pdserve.engine.parallel.tp import ModelSource
    from pdserve.engine.model.weights import load_model

    cfg = EngineConfig(device="cuda", quantization="none", attention="auto", cache=CacheConfig(kv_cache_memory=64 << 20))
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    prompt = list(range(100, 400))
    out: dict = {}
    try:
        one = LLMEngine(load_model(model or None, device="cuda", quantization="none"), cfg)
        t = time.perf_counter()
        want = one.generate([prompt], params)
        out["tp1_s"] = time.perf_counter() - t
        e = LLMEngine.tensor_parallel(ModelSource(model=model), cfg, 3)
        try:
            t = time.perf_counter()
            got = e.generate([prompt], params)
            out["tp3_s"] = time.perf_counter() - t
            g = e.tp.group
            out["allreduce_ms_each"] = 1e3 * g.allreduce_s / max(g.allreduces, 1)
            out["greedy_equal"] = got == want
            e.add_request("x", prompt, SamplingParams(max_tokens=1, temperature=0), hold_kv=True)
            while e.has_unfinished_requests():
                e.step()
            t = time.perf_counter()
            _, kv = e.export_kv("x")
            out["kv_export_ms"] = 1e3 * (time.perf_counter() - t)
            e.release_kv("x")
            e.add_remote_request("y", prompt, SamplingParams(max_tokens=2, temperature=0))
            t = time.perf_counter()
            e.import_kv("y", kv, 5)
            out["kv_import_ms"] = 1e3 * (time.perf_counter() - t)
            e.abort_all()
        finally:
            e.shutdown()
    except Exception as exc:  # noqa: BLE001 - reported in the results
        out["error"] = repr(exc)
    print("tensor parallelism on CUDA:", out)
    return out


def check_lora() -> dict:
    """The Triton LoRA kernel against the torch ops (engine/model/lora_batch.py) on SmolLM2's
    fused matrices in bf16: rank 16 on every projection, the rows spread over 1, 4 or 16
    adapters, decode-sized (64 rows) and prefill-sized (1024) steps; the largest difference
    and each path's time per update. Failures are reported, not raised."""
    from pdserve.engine.model.lora import LoRAAdapter, fuse_layer
    from pdserve.engine.model.lora_batch import LoRABatch

    shapes = {"q_proj": (576, 576), "k_proj": (192, 576), "v_proj": (192, 576), "o_proj": (576, 576),
              "gate_proj": (1536, 576), "up_proj": (1536, 576), "down_proj": (576, 1536)}
    widths = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}
    out: dict = {}
    try:
        def adapter(i: int) -> LoRAAdapter:
            pairs = {p: (torch.randn(16, k) * k ** -0.5, torch.randn(n, 16) * 0.25) for p, (n, k) in shapes.items()}
            a = LoRAAdapter(f"a{i}", None, 16, 2.0, tuple(shapes), "0" * 64,
                            [fuse_layer(pairs, shapes, 2.0, torch.bfloat16, "cuda")])
            a.id = i + 1
            return a
        adapters = [adapter(i) for i in range(16)]
        for rows in (64, 1024):
            for n in (1, 4, 16):
                per = rows // n  # a quarter of each adapter's share runs on the base
                spans = [(j * per, j * per + per * 3 // 4, adapters[j]) for j in range(n)]
                spans += [(j * per + per * 3 // 4, (j + 1) * per, None) for j in range(n)]
                for matrix, (k, width) in widths.items():
                    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
                    y = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)
                    by = {}
                    for kernel in (True, False):
                        batch = LoRABatch.of_spans(spans, rows, "cuda")
                        batch.triton = kernel
                        layer = batch.layer(0)
                        got = layer.add(matrix, x, y.clone())
                        by[kernel] = (got, timed(lambda: layer.add(matrix, x, y.clone())))
                    err = float((by[True][0].float() - by[False][0].float()).abs().max())
                    key = f"{matrix} rows{rows} adapters{n}"
                    out[key] = {"max_abs_err": err, "triton_us": by[True][1] * 1e6, "torch_us": by[False][1] * 1e6,
                                "speedup": by[False][1] / by[True][1]}
                    print(f"LoRA {key:28s} err {err:.1e}  triton {by[True][1] * 1e6:8.1f} us  "
                          f"torch {by[False][1] * 1e6:8.1f} us")
    except Exception as exc:  # noqa: BLE001 - reported in the results
        out["error"] = repr(exc)
        print("LoRA kernel check failed:", repr(exc))
    return out


def check_moe() -> dict:
    """The Triton MoE kernel against the torch grouping (engine/model/moe.py) on a Mixtral-like
    layer scaled down (hidden 1024, 8 experts of 2816, top 2) in bf16 and fp32, at 1, 64 and
    1024 rows: the largest difference and each path's time. Failures are reported, not raised."""
    from pdserve.engine.config import ModelConfig
    from pdserve.engine.model.moe import SparseMoeBlock

    cfg = ModelConfig(vocab_size=32, hidden_size=1024, intermediate_size=2816, num_hidden_layers=1,
                      num_attention_heads=8, num_key_value_heads=8, model_type="mixtral", num_experts=8,
                      num_experts_per_tok=2, norm_topk_prob=True)
    out: dict = {}
    try:
        for dtype in (torch.bfloat16, torch.float32):
            block = SparseMoeBlock(cfg).to("cuda", dtype)
            block.fuse(packed=False)
            assert block.triton, "fuse did not pick the Triton kernel on CUDA"
            for rows in (1, 64, 1024):
                x = torch.randn(rows, cfg.hidden_size, device="cuda", dtype=dtype)
                by = {}
                with torch.no_grad():
                    for kernel in (True, False):
                        block.triton = kernel
                        by[kernel] = (block(x), timed(lambda: block(x)))
                block.triton = True
                err = float((by[True][0].float() - by[False][0].float()).abs().max())
                scale = float(by[False][0].float().abs().max())
                key = f"{str(dtype).split('.')[-1]} rows{rows}"
                out[key] = {"max_abs_err": err, "max_abs": scale, "triton_us": by[True][1] * 1e6,
                            "torch_us": by[False][1] * 1e6, "speedup": by[False][1] / by[True][1]}
                print(f"MoE {key:16s} err {err:.1e} (of {scale:.1e})  triton {by[True][1] * 1e6:8.1f} us  "
                      f"torch {by[False][1] * 1e6:8.1f} us")
    except Exception as exc:  # noqa: BLE001 - reported in the results
        out["error"] = repr(exc)
        print("MoE kernel check failed:", repr(exc))
    return out


def main(model: str = "") -> None:
    if not torch.cuda.is_available():
        print("no CUDA device: the GPU checks are skipped (run this where a GPU is available)")
        return
    from pdserve.engine.kv import formats as kv_format
    from pdserve.engine.kernels.attention import AttentionMetadata, TorchAttentionBackend
    from pdserve.engine.kernels.triton_kernels import paged_decode_attention

    results = {}
    n_heads, n_kv, hd, bs = 9, 3, 64, 16  # SmolLM2-135M
    for kind in ("float16", "bfloat16", "float32", "int8", "float8_e4m3fn"):
        fmt = kv_format.FORMATS[kind]
        dtype = torch.float16 if fmt.quantized else fmt.dtype  # the queries' (the model's) dtype
        for batch, ctx in ((1, 512), (32, 512), (32, 2048), (128, 1024)):
            blocks_per = ctx // bs
            kc, vc = (kv_format.encode(torch.randn(batch * blocks_per + 1, bs, n_kv, hd, device="cuda"), fmt)
                      for _ in range(2))
            tables = torch.randperm(batch * blocks_per, device="cuda").view(batch, blocks_per)
            lens = torch.full((batch,), ctx, device="cuda")
            q = torch.randn(batch, n_heads, hd, device="cuda", dtype=dtype)
            meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long, device="cuda"),
                                     num_decode_tokens=batch, decode_block_tables=tables, decode_seq_lens=lens,
                                     prefills=[], block_size=bs)
            ref_backend = TorchAttentionBackend()
            ref_backend.prepare(meta)
            ref = ref_backend.decode(q, kc, vc, meta).float()
            got = paged_decode_attention(q, kc, vc, tables, lens)
            err = float((got - ref).abs().max())
            t_triton = timed(lambda: paged_decode_attention(q, kc, vc, tables, lens))
            t_torch = timed(lambda: ref_backend.decode(q, kc, vc, meta))
            key = f"{kind} b{batch} ctx{ctx}"
            results[key] = {"max_abs_err": err, "triton_us": t_triton * 1e6, "torch_us": t_torch * 1e6,
                            "speedup": t_torch / t_triton}
            print(f"{key:24s} err {err:.1e}  triton {t_triton * 1e6:8.1f} us  torch {t_torch * 1e6:8.1f} us  "
                  f"x{t_torch / t_triton:.2f}")
    results["lora_kernel"] = check_lora()
    results["moe_kernel"] = check_moe()
    results["sampler_on_cuda"] = check_sampler_on_cuda()
    results["tensor_parallel"] = check_tp(model)
    out = Path(__file__).with_name("gpu-results.json")
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "results": results}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    import sys

    main(sys.argv[1] if len(sys.argv) > 1 else "")
