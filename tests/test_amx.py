"""Prompt rows in bf16 on AMX tiles (engine/kernels/native/amx.c, quant.PromptBf16Linear, and their
attention: amx_attention.c): the kernels against fp64 sums of the same bf16 operands, a row's
result independent of its batch, chunking and thread count, the split of a step's rows (prompt
rows on AMX, every other row bitwise W4A8 and the fp32 attention), and through the engine: the
same greedy tokens alone, batched, preempted and from the prefix cache. The dispatch: a CPU
without AMX, or PDSERVE_ISA naming a lower build, keeps W4A8."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from conftest import assert_engine_clean
from tests.helpers.reference import bf16_attention_reference
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.core.engine import LLMEngine
from pdserve.engine.kernels import native
from pdserve.engine.kernels.attention import AMX_PROMPT_ROWS, AttentionMetadata, NativeAttentionBackend, PrefillSpan
from pdserve.engine.kernels.native import amx, w4a8
from pdserve.engine.model import quant
from pdserve.engine.model.quant import PromptBf16Linear, PromptRows

needs_amx = pytest.mark.skipif(not amx.available(), reason="this CPU has no AMX (or the build is a lower one)")


def _q4_grid(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, tuple]:
    g = torch.Generator().manual_seed(seed)
    packed = native.quantize_q4_1(torch.randn(n, k, generator=g) * 0.05)
    return native.dequantize_q4_1(*packed), packed


def test_prompt_rows_merge_touching_ranges_and_drop_empty_ones():
    rows = PromptRows()
    rows.set([(0, 3), (3, 5), (6, 6), (8, 10)], 12)
    assert rows.ranges == [(0, 5), (8, 10)] and rows.rows == 12
    rows.clear()
    assert rows.ranges == [] and rows.rows == 0


@needs_amx
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (32, 32)])
@pytest.mark.parametrize("m", [1, 5, 31, 32, 33, 70])
def test_the_amx_matmul_sums_the_bf16_operands_in_fp32(n, k, m):
    w, _ = _q4_grid(n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3
    y = amx.matmul(x, amx.pack(w))
    xb, wb = x.bfloat16().double(), w.bfloat16().double()
    ref, scale = xb @ wb.T, xb.abs() @ wb.abs().T
    assert y.dtype is torch.float32 and y.shape == (m, n)
    assert ((y.double() - ref).abs() <= 2e-6 * scale + 1e-30).all()  # fp32 sums of exact bf16 products
    assert (y.double() - x.double() @ w.double().T).abs().max() > 0  # the activations were rounded


@needs_amx
def test_a_rows_result_does_not_depend_on_its_batch_or_the_thread_count():
    w, _ = _q4_grid(576, 1536)
    tiles = amx.pack(w)
    x = torch.randn(70, 1536, generator=torch.Generator().manual_seed(3))
    threads = torch.get_num_threads()
    try:
        batch = amx.matmul(x, tiles)
        torch.set_num_threads(1)
        one_thread = amx.matmul(x, tiles)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(batch, one_thread)
    for lo, hi in ((0, 1), (69, 70), (31, 33), (5, 40)):
        assert torch.equal(amx.matmul(x[lo:hi].contiguous(), tiles), batch[lo:hi])


def test_the_tiles_hold_each_column_pair_where_the_tile_multiply_reads_it():
    w = torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64)  # every value exact in bf16 below 256 * 2^8
    t = amx.pack(w)
    assert t.dtype is torch.bfloat16 and t.shape == (4, 2, 16, 32)
    for col, kk in ((0, 0), (17, 5), (63, 63), (40, 33)):
        c, j, b, r, e = col // 16, col % 16, kk // 32, (kk % 32) // 2, kk % 2
        assert t[c, b, r, 2 * j + e].item() == w[col, kk].bfloat16().item()


@pytest.mark.parametrize("shape", [(48, 64), (64, 48), (64,)])
def test_a_matrix_the_tiles_cannot_take_is_refused_by_name(shape):
    with pytest.raises(ValueError, match="multiples of 32"):
        amx.pack(torch.zeros(shape))


@needs_amx
def test_bad_activations_are_refused_before_the_c_call():
    tiles = amx.pack(torch.zeros(64, 64))
    for x in (torch.zeros(3, 32), torch.zeros(3, 64, dtype=torch.float64), torch.zeros(64, 3).T):
        with pytest.raises(ValueError, match="expected contiguous CPU x fp32"):
            amx.matmul(x, tiles)


@needs_amx
def test_prompt_rows_run_on_amx_and_every_other_row_bitwise_on_w4a8():
    w, packed = _q4_grid(960, 576, seed=1)
    rows = PromptRows()
    lin = PromptBf16Linear(packed, w, rows)
    x = torch.randn(12, 576, generator=torch.Generator().manual_seed(5))
    as_w4a8 = w4a8.matmul(x, *lin.packed)
    as_amx = amx.matmul(x, lin.tiles)
    assert torch.equal(lin(x), as_w4a8)  # outside a step: no prompt rows
    rows.set([(2, 5), (7, 9), (11, 12)], 12)
    y = lin(x)
    prompt = torch.zeros(12, dtype=torch.bool)
    for lo, hi in rows.ranges:
        prompt[lo:hi] = True
    assert torch.equal(y[prompt], as_amx[prompt]) and torch.equal(y[~prompt], as_w4a8[~prompt])
    assert torch.equal(lin(x[:5].contiguous()), as_w4a8[:5])  # a subset of the step's rows: none are its prompt rows
    rows.set([(0, 12)], 12)
    assert torch.equal(lin(x), as_amx)


def _paged(seed: int, dtype=torch.float32, blocks: int = 40, kvh: int = 3):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(blocks, 16, kvh, 64, generator=g) * 2).to(dtype) for _ in range(2)]


@needs_amx
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompt_attention_on_amx_sums_the_bf16_operands_and_a_rows_result_is_its_own(dtype):
    """A 150-token prompt after 37 cached tokens: every row against fp64 (the weights rounded to
    bf16 are the only difference), and rows alone, in other chunks or on one thread bitwise equal."""
    kc, vc = _paged(1, dtype)
    table = torch.randperm(40, generator=torch.Generator().manual_seed(2))[:12]
    lens = torch.arange(38, 188)
    tables, lens = native.paged_attention_tables(table.expand(150, -1).contiguous(), lens, 16)
    q = torch.randn(150, 9, 64, generator=torch.Generator().manual_seed(3))
    out = amx.attention(q, kc, vc, tables, lens)
    ref = bf16_attention_reference(q, kc.float(), vc.float(), table.tolist(), lens)
    assert (out.double() - ref).abs().max() < 2e-2  # the weights' bf16 rounding: ~2^-9 of |v| <= 8
    for lo, hi in ((0, 1), (149, 150), (10, 43), (16, 48), (0, 150)):
        part = amx.attention(q[lo:hi], kc, vc, tables[lo:hi].contiguous(), lens[lo:hi].contiguous())
        assert torch.equal(part, out[lo:hi])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(amx.attention(q, kc, vc, tables, lens), out)
    finally:
        torch.set_num_threads(threads)


@needs_amx
def test_a_step_runs_its_prompt_rows_attention_on_amx_and_its_decode_rows_on_fp32():
    kc, vc = _paged(4)
    q, k, v = (torch.randn(23, n, 64, generator=torch.Generator().manual_seed(5 + n)) for n in (9, 3, 3))
    slots = torch.cat([torch.tensor([40, 81]), torch.arange(160, 181)])  # two decode rows, one 21-token span
    decode_tables = torch.tensor([[0, 1, 2, 0], [3, 4, 5, 6]])
    meta = AttentionMetadata(slots, 2, decode_tables, torch.tensor([41, 50]),
                             [PrefillSpan(2, 23, 0, [10, 11], prompt_rows=15)], 16)
    backend = NativeAttentionBackend()
    backend.prepare(meta)
    meta.backend_state[AMX_PROMPT_ROWS] = meta.prompt_ranges()
    assert meta.prompt_ranges() == [(2, 17)]
    out = backend.forward(q, k, v, kc, vc, meta)
    st = meta.backend_state
    fp32 = native.paged_decode_attention(q, kc, vc, st["tables"], st["lens"], checked=True)
    on_amx = amx.attention(q[2:17], kc, vc, st["tables"][2:17].contiguous(), st["lens"][2:17].contiguous())
    assert torch.equal(out[:2], fp32[:2]) and torch.equal(out[17:], fp32[17:])
    assert torch.equal(out[2:17], on_amx) and not torch.equal(on_amx, fp32[2:17])


@needs_amx
def test_attention_the_amx_kernel_cannot_take_is_refused_by_name():
    kc, vc = _paged(6)
    tables, lens = native.paged_attention_tables(torch.tensor([[0, 1]]), torch.tensor([20]), 16)
    for q, k in ((torch.zeros(1, 9, 32), kc), (torch.zeros(1, 9, 64), kc.to(torch.int8)),
                 (torch.zeros(1, 9, 64, dtype=torch.float64), kc)):
        with pytest.raises(ValueError, match="expected q fp32"):
            amx.attention(q, k, vc if k is kc else k, tables, lens)


@needs_amx
def test_the_engine_answers_the_same_alone_batched_preempted_and_from_the_prefix_cache(smollm, monkeypatch):
    """The default model under "auto": prompts run on AMX (a spy sees prompt rows), decodes on
    W4A8; each request's greedy tokens are the same alone, batched, with preemption in a cache
    too small for all (its generated tokens recomputed: on W4A8, as they were made), and again
    from the prefix cache (the last prompt token then a one-token chunk, still a prompt row)."""
    loaded, tok = smollm
    assert loaded.model.prompt_rows is not None
    seen = []
    real = PromptBf16Linear.__call__

    def spy(self, x):
        seen.append(sum(hi - lo for lo, hi in self.rows.ranges) if self.rows.rows == x.shape[0] else 0)
        return real(self, x)

    monkeypatch.setattr(PromptBf16Linear, "__call__", spy)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": c}]), add_special_tokens=False)
               for c in ("Write a haiku about rivers.", "What is 17 times 3? Explain each step of the sum. " * 3,
                         "Name three primes.", "def fibonacci(n):")]
    prompts = [p[:len(p) - (len(p) - 1) % 16] for p in prompts]  # 16 k + 1 tokens: a hit leaves one to compute
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)

    def engine(kv: int, budget: int, seqs: int) -> LLMEngine:
        return LLMEngine(loaded, EngineConfig(cache=CacheConfig(block_size=16, kv_cache_memory=kv),
                                              scheduler=SchedulerConfig(max_num_seqs=seqs,
                                                                        max_num_batched_tokens=budget)), tok)

    big = engine(32 << 20, 512, 64)
    alone = [big.generate([p], params)[0] for p in prompts]
    assert max(seen) > 48  # whole prompts on AMX (after the chat template's cached block); decodes: the native step
    again = [big.generate([p], params)[0] for p in prompts]  # prefix-cache hits
    assert big.blocks.num_cached_blocks > 0
    assert again == alone and big.generate(prompts, params) == alone
    assert_engine_clean(big)
    small = engine(5 << 20, 48, 8)  # ~210 tokens of bf16 KV for ~400 wanted: preemption, 48-token chunks
    preempted = small.generate(prompts, params)
    assert_engine_clean(small)
    assert preempted == alone
    assert small.scheduler.preemptions["memory"] > 0


_DISPATCH = """
import json, sys
from pdserve.engine.kernels.native import amx, isa
from pdserve.engine.model import quant
from pdserve.engine.kernels import native
w = native.dequantize_q4_1(*native.quantize_q4_1(__import__("torch").randn(64, 64) * 0.05))
rows = quant.amx_prompt_rows("auto")
json.dump({"isa": isa(), "amx": amx.available(), "rows": rows is not None,
           "kernel": type(quant.make_linear(w, "auto", True, rows)).__name__,
           "exact": quant.amx_prompt_rows("exact") is not None}, sys.stdout)
"""


@pytest.mark.skipif("avx512-vnni" not in native.isas(), reason="needs an AVX-512 VNNI CPU to force the lower build")
def test_a_lower_build_or_a_cpu_without_amx_keeps_every_row_on_w4a8():
    r = subprocess.run([sys.executable, "-c", _DISPATCH], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PDSERVE_ISA="avx512-vnni"))
    assert r.returncode == 0, r.stderr
    import json
    got = json.loads(r.stdout)
    assert got == {"isa": "avx512-vnni", "amx": False, "rows": False, "kernel": "W4A8Linear", "exact": False}


@needs_amx
def test_this_cpus_default_build_puts_auto_prompt_rows_on_amx_and_nothing_else():
    w, _ = _q4_grid(64, 64)
    rows = quant.amx_prompt_rows("auto")
    assert rows is not None and quant.amx_prompt_rows("exact") is None
    assert type(quant.make_linear(w, "auto", True, rows)) is PromptBf16Linear
    assert type(quant.make_linear(w, "auto", True)) is quant.W4A8Linear  # a model that asks for none
    assert type(quant.make_linear(w, "exact", True, rows)) is quant.WeightOnlyLinear
