"""The decode step in one C call (engine/kernels/native/step.c, engine/model/native_step.py):
on the real default model at "auto" (W4A8 weights) over an fp32, bf16, int8 or fp8 KV cache a
decode-only step gives bitwise the Python path's hidden states and K/V (tolerance 0: the C
loop calls the same kernels on the same inputs, rounds the new K/V to bf16 as torch does and
encodes 8-bit rows as native.kv_store_8bit does), so greedy tokens agree over many steps,
through the engine too; a model or a step it does not cover (the tiny fp32 model, prompt rows
over an 8-bit cache) runs the Python path."""
from __future__ import annotations

import pytest
import torch

from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.core.engine import LLMEngine
from pdserve.engine.kernels import native
from pdserve.engine.kernels.attention import AttentionMetadata, NativeAttentionBackend, PrefillSpan
from pdserve.engine.kernels.native import step, w4a8
from pdserve.engine.model import native_step
from pdserve.engine.model.tiny import tiny_llama

from conftest import assert_engine_clean

pytestmark = pytest.mark.skipif(not native.available() or not w4a8.available(),
                                reason="the native step needs the native build with AVX2")

BS = 16
KV_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8, "fp8": torch.float8_e4m3fn}


@pytest.fixture
def model(smollm):
    """The default model with the C attention backend and native ops (restored afterwards:
    the session's other tests share it)."""
    m = smollm[0].model
    backend, ops = m.backend, m.native_ops
    m.backend = NativeAttentionBackend()
    m.use_native_ops(True)
    assert m.native_decode is not None, native_step.why_not(m)
    yield m
    m.backend = backend
    m.use_native_ops(ops)


@pytest.fixture
def step_calls(monkeypatch):
    """How many steps ran natively (step.run is the one C call)."""
    calls = []
    real = step.run

    def spy(*args, **kw):
        calls.append(args[1].shape[0])
        return real(*args, **kw)

    monkeypatch.setattr(step, "run", spy)
    return calls


def _forward(m, ids, pos, layers, meta, native_on: bool):
    saved = m.native_decode
    m.native_decode = saved if native_on else None
    try:
        m.backend.prepare(meta)
        with torch.inference_mode():
            return m(ids, pos, layers, meta)
    finally:
        m.native_decode = saved


def _prefill(m, prompts: list[list[int]], kv: torch.Tensor, tables: list[list[int]]) -> None:
    """Every prompt's K/V into the cache by the Python path (one prefill span each)."""
    layers = [(kv[i, 0], kv[i, 1]) for i in range(kv.shape[0])]
    for prompt, table in zip(prompts, tables):
        n = len(prompt)
        slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(n)])
        meta = AttentionMetadata(slots, 0, torch.zeros(0, 0, dtype=torch.long), torch.zeros(0, dtype=torch.long),
                                 [PrefillSpan(0, n, 0, table)], BS)
        _forward(m, torch.tensor(prompt), torch.arange(n), layers, meta, native_on=False)


def _decode_meta(lens: list[int], tables: list[list[int]]) -> AttentionMetadata:
    """A decode-only step: each row's new token at position lens[i] - 1."""
    slots = torch.tensor([t[(n - 1) // BS] * BS + (n - 1) % BS for n, t in zip(lens, tables)])
    width = max(len(t) for t in tables)
    return AttentionMetadata(slots, len(lens), torch.tensor([t + [0] * (width - len(t)) for t in tables]),
                             torch.tensor(lens), [], BS)


@pytest.mark.parametrize("prompt_lens,schedule,kv", [
    ([13], "team", "fp32"), ([5, 16, 31], "team", "fp32"), ([5, 16, 31], "per_op", "fp32"),
    ([13], "team", "bf16"), ([5, 16, 31], "team", "bf16"), ([5, 16, 31], "per_op", "bf16"),
    ([5, 16, 31, 2, 20, 9], "split", "bf16"), ([5, 16, 31], "team", "int8"), ([5, 16, 31], "per_op", "int8"),
    ([5, 16, 31, 2], "team", "bf16"), ([5, 16, 31, 2], "team", "fp32"),  # one team, a row an attention item
    ([5, 16, 31, 2, 20, 9], "team", "fp32"), ([5, 16, 31, 2, 20, 9, 40], "split", "int8"),
    ([5, 16, 31, 2, 20, 9], "per_op", "bf16"), ([13], "team", "fp8"), ([5, 16, 31, 2, 20, 9], "split", "fp8"),
    ([5, 16, 31, 2, 20, 9], "taken", "bf16"), ([5, 16, 31, 2, 20, 9, 40, 7], "taken", "fp32"),
    ([5, 16, 31, 2, 20, 9], "taken", "int8")])
def test_the_native_step_equals_the_python_path_over_32_greedy_steps(model, step_calls, prompt_lens, schedule, kv):
    """Both paths decode from the same prefilled cache, each in its own copy; every step's
    hidden states and every layer's K/V are bitwise equal, so every greedy token is. The
    lengths cross block boundaries (16-token blocks) during the 32 steps. Each of step.c's
    schedules (one OpenMP team for the step, the rows split between the threads, or a region
    per op), over fp32, bf16, int8 and fp8 caches (the C step's bf16 rounding and 8-bit rows of
    the new K/V are the Python path's: the caches stay equal). "taken": split with every row
    starting on the first of two threads, so the second takes rows over, layers in (the MLP
    outputs it copies, the rows' residual stream), and rows change hands again as either
    finishes first."""
    cfg, steps, kv_dtype = model.config, 32, KV_DTYPES[kv]
    width = cfg.head_dim + (4 if kv in ("int8", "fp8") else 0)  # an 8-bit row: its codes, then its scale
    nd = model.native_decode
    nd.one_region, nd.team_rows = schedule != "per_op", 64 if schedule == "team" else 4
    nd.split_rows, taken, threads = 3 if schedule == "taken" else 2, step.rows_taken(), torch.get_num_threads()
    if schedule == "taken":
        torch.set_num_threads(2)  # the split schedule needs two threads, whatever the host
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 10000, (n,), generator=g).tolist() for n in prompt_lens]
    per = (max(prompt_lens) + steps + BS - 1) // BS
    tables = [list(range(1 + i * per, 1 + (i + 1) * per)) for i in range(len(prompts))]
    kv = torch.zeros(cfg.num_hidden_layers, 2, 1 + per * len(prompts), BS, cfg.num_key_value_heads, width,
                     dtype=kv_dtype)
    _prefill(model, prompts, kv, tables)
    caches = {on: kv.clone() for on in (False, True)}
    layers = {on: [(c[i, 0], c[i, 1]) for i in range(c.shape[0])] for on, c in caches.items()}
    tokens = {on: [p[-1] for p in prompts] for on in (False, True)}
    lens = list(prompt_lens)
    for _ in range(steps):
        lens = [n + 1 for n in lens]
        hidden = {}
        for on in (False, True):
            meta = _decode_meta(lens, tables)
            ids, pos = torch.tensor(tokens[on]), torch.tensor([n - 1 for n in lens])
            hidden[on] = _forward(model, ids, pos, layers[on], meta, on)
            with torch.inference_mode():
                tokens[on] = model.compute_logits(hidden[on]).argmax(-1).tolist()
        assert torch.equal(hidden[True], hidden[False]), (hidden[True] - hidden[False]).abs().max()
        assert tokens[True] == tokens[False]
    assert torch.equal(caches[True].view(torch.uint8), caches[False].view(torch.uint8))
    assert caches[True].dtype is kv_dtype and caches[True].view(torch.uint8).any()
    assert step_calls == [len(prompts)] * steps  # the native step did run
    assert step.rows_taken() > taken or schedule != "taken"  # rows did change hands
    nd.one_region, nd.team_rows, nd.split_rows = True, 4, 2
    torch.set_num_threads(threads)


def _greedy(eng: LLMEngine, prompts: list[list[int]], max_tokens: int = 24) -> list[list[int]]:
    return eng.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp32", "int8"])
def test_the_engine_gives_the_same_tokens_with_the_native_step_on_and_off(smollm, step_calls, kv_cache_dtype):
    """End to end through LLMEngine: prompts of different lengths, prefilled and decoded
    together (every step natively, or every step in Python), then every KV block
    is back; with the default (bf16 where the model's matrices quantize their activations, as
    the default numerics do on a CPU with AVX2), an fp32 and an int8 KV cache."""
    loaded, tok = smollm
    backend, ops = loaded.model.backend, loaded.model.native_ops
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": c}]), add_special_tokens=False)
               for c in ("Write a haiku about rivers.", "What is 17 times 3?", "Name three primes.")]
    outs = {}
    try:
        for on in (True, False):
            eng = LLMEngine(loaded, EngineConfig(cache=CacheConfig(kv_cache_memory=16 << 20,
                                                                   kv_cache_dtype=kv_cache_dtype)), tok)
            assert loaded.model.native_decode is not None
            auto = torch.bfloat16 if loaded.model.int8_activation_matrices() else torch.float32
            assert eng.kv_cache.kv.dtype is KV_DTYPES.get(kv_cache_dtype, auto)
            if not on:
                loaded.model.native_decode = None
            outs[on] = _greedy(eng, prompts)
            assert_engine_clean(eng)
    finally:
        loaded.model.backend = backend
        loaded.model.use_native_ops(ops)
    assert outs[True] == outs[False] and all(len(o) == 24 for o in outs[True])
    assert len(prompts) in step_calls  # the decode steps
    # the prefills too, but over an 8-bit cache (their rows attend over a decoded copy in Python)
    # or where prompt rows run on AMX tiles
    assert (max(step_calls) > len(prompts)) == (kv_cache_dtype not in ("int8", "fp8") and loaded.model.prompt_rows is None)


def test_an_ineligible_model_falls_back_to_the_python_path(make_engine, step_calls):
    """The tiny fp32 test model has no W4A8 matrices: no native step, the engine still runs.
    (An 8-bit KV cache's decode steps run natively: the engine test above, and
    tests/test_native_step's step test.)"""
    tiny = tiny_llama(0)
    eng = make_engine(tiny=True, loaded=tiny)
    assert tiny.model.native_ops and tiny.model.native_decode is None
    assert native_step.why_not(tiny.model) == "not every matrix on W4A8 weights"
    assert len(_greedy(eng, [[1, 2, 3, 4, 5]], 8)[0]) == 8
    assert step_calls == []


def test_a_step_with_a_hook_in_a_pipeline_or_tensor_parallelism_is_not_native(model):
    meta = _decode_meta([5], [[1]])
    layers = [(torch.zeros(2, BS, 3, 64), torch.zeros(2, BS, 3, 64))]
    assert native_step.usable(model, layers, meta, None)
    assert native_step.usable(model, layers, meta, after_layer=lambda i: None)  # the C step calls it
    model.pp = object()  # a pipeline stage's C call takes no hook
    try:
        assert not native_step.usable(model, layers, meta, after_layer=lambda i: None)
    finally:
        model.pp = None
    n = 300  # prompt chunks of any size run natively (test_native_step_prompts.py)
    prefill = AttentionMetadata(meta.slot_mapping, 1, meta.decode_block_tables, meta.decode_seq_lens,
                                [PrefillSpan(1, 1 + n, 0, [1] * (n // BS + 1))], BS)
    assert native_step.usable(model, layers, prefill, None)
    assert native_step.usable(model, layers, prefill, after_layer=lambda i: None)
    assert native_step.usable(model, [(k.bfloat16(), v.bfloat16()) for k, v in layers], meta, None)
    small = AttentionMetadata(meta.slot_mapping, 1, meta.decode_block_tables, meta.decode_seq_lens,
                              [PrefillSpan(1, 5, 0, [1])], BS)
    assert native_step.usable(model, layers, small, None)
    for dtype in (torch.int8, torch.float8_e4m3fn):  # 8-bit: decode rows only (prompt rows attend over a copy)
        codes = [(k.to(dtype), v.to(dtype)) for k, v in layers]
        assert native_step.usable(model, codes, meta, None) and not native_step.usable(model, codes, small, None)
    assert not native_step.usable(model, [(k.half(), v.half()) for k, v in layers], meta, None)
    model.tp = object()
    try:
        assert not native_step.usable(model, layers, meta, None)
    finally:
        del model.tp


def test_bad_rows_are_refused_before_the_c_call(model):
    """A slot outside the cache, a position outside the RoPE tables or an 8-bit cache without
    its rows' scales raises, naming them."""
    cfg = model.config
    kv = torch.zeros(cfg.num_hidden_layers, 2, 2, BS, cfg.num_key_value_heads, cfg.head_dim)
    layers = [(kv[i, 0], kv[i, 1]) for i in range(cfg.num_hidden_layers)]
    h = torch.zeros(1, cfg.hidden_size)
    tables, lens = torch.tensor([[1]]), torch.tensor([3])
    rot = model.rotary
    with pytest.raises(ValueError, match="every slot in the cache"):
        step.run(model.native_decode, h, layers, torch.tensor([2]), rot.cos, rot.sin, torch.tensor([2 * BS]),
                 tables, lens)
    with pytest.raises(ValueError, match="RoPE tables"):
        step.run(model.native_decode, h, layers, torch.tensor([rot.cos.shape[0]]), rot.cos, rot.sin,
                 torch.tensor([BS + 2]), tables, lens)
    with pytest.raises(ValueError, match="int8 or fp8 caches"):
        step.run(model.native_decode, h, [(k.to(torch.int8), v.to(torch.int8)) for k, v in layers], torch.tensor([2]),
                 rot.cos, rot.sin, torch.tensor([BS + 2]), tables, lens)


@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (8, 32), (3072, 576)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 32, 65])
def test_the_nibble_weights_give_bitwise_the_w4a8_kernels_result(n, k, rows):
    """step.c's matmul reads half the bytes (two 4-bit weights a byte) for exactly w4a8.c's sums."""
    g = torch.Generator().manual_seed(n + k + rows)
    q, d, m = w4a8.pack(*native.quantize_q4_1(torch.randn(n, k, generator=g) * 0.05))
    x = torch.randn(rows, k, generator=g) * 3
    x[0, :16] = 0.0
    assert torch.equal(step.nibble_matmul(x, step.nibbles(q), d, m), w4a8.matmul(x, q, d, m))
    d, m = d.half().float(), m.half().float()  # a GGUF's Q4_1 scales and minima: fp16 values
    dm = step.half_scales(d, m)
    assert dm is not None and dm.dtype is torch.float16 and dm.shape == (*d.shape[:2], 2, 8)
    assert torch.equal(step.nibble_matmul(x, step.nibbles(q), d, m, dm), w4a8.matmul(x, q, d, m))


def test_the_default_models_step_reads_fp16_scales_and_a_scale_off_fp16_keeps_fp32(model):
    """A GGUF's Q4_1 scales are fp16 values: every matrix of the default model's step reads
    them in fp16 (a sixth fewer bytes); one scale that fp16 cannot hold keeps that matrix's fp32
    ones, and a malformed dm is refused before the C call."""
    assert all(t is not None and t.dtype is torch.float16 for lw in model.native_decode.layers for t in lw.half)
    q, d, m = model.model.layers[0].mlp.down_linear.packed
    assert torch.equal(step.half_scales(d, m)[:, :, 0], d.half()) and torch.equal(step.half_scales(d, m)[:, :, 1], m.half())
    off = d.clone()
    off[3, 2, 5] = 1.0 + 2.0 ** -20  # not an fp16 value
    assert step.half_scales(off, m) is None and step.half_scales(d, m.double()) is None
    x, wn = torch.randn(3, q.shape[1] * 4), step.nibbles(q)
    with pytest.raises(ValueError, match="half_scales' dm"):
        step.nibble_matmul(x, wn, d, m, step.half_scales(d, m)[:, :, 0].contiguous())
    with pytest.raises(ValueError, match="half_scales' dm"):
        step.nibble_matmul(x, wn, d, m, step.half_scales(d, m).float())
