"""Long prompt rows' attention in AVX-512 BF16 vectors (engine/kernels/native/bf16_attention.c, the
flash kernel of flash.h): the kernel against fp64 sums of the same bf16 operands, a row's result
its own whatever its run, chunk or thread count; which rows of a step take it (prompt rows from
BF16_ATTENTION_FROM on, under "auto", where the CPU has AVX-512 BF16 and no AMX), and through the
engine: the same greedy tokens for a long prompt alone, batched, chunked, preempted and from the
prefix cache, every KV block back."""
from __future__ import annotations

import pytest
import torch

from conftest import assert_engine_clean
from tests.helpers.reference import bf16_attention_reference
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.kernels import native
from pdserve.engine.kernels.attention import (BF16_ATTENTION_FROM, BF16_PROMPTS_FROM, AttentionMetadata,
                                              NativeAttentionBackend, PrefillSpan)
from pdserve.engine.kernels.native import amx
from pdserve.engine.model import native_step

needs_bf16 = pytest.mark.skipif(not amx.vector_attention_available(),
                                reason="this CPU has no AVX-512 BF16 (or the build is a lower one)")


def _paged(seed: int, dtype=torch.float32, blocks: int = 140) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return tuple((torch.randn(blocks, 16, 3, 64, generator=g) * 2).to(dtype) for _ in range(2))


def test_the_rows_from_a_position_are_each_spans_prompt_rows_past_it():
    """A span's row i is at position num_cached + i; its generated (recomputed) rows never count."""
    meta = AttentionMetadata(torch.zeros(0), 2, torch.zeros(2, 1), torch.ones(2), [
        PrefillSpan(2, 102, 200, [], prompt_rows=100),   # positions 200..299: rows 58.. from 258
        PrefillSpan(102, 142, 0, [], prompt_rows=40),    # positions 0..39: none
        PrefillSpan(142, 172, 300, [], prompt_rows=20),  # positions 300..319 prompt, then 10 recomputed
    ], 16)
    assert meta.prompt_ranges_from(258) == [(60, 102), (142, 162)]
    assert meta.prompt_ranges_from(0) == meta.prompt_ranges() == [(2, 102), (102, 142), (142, 162)]
    assert meta.bf16_prompt_ranges() == []  # no model asked for it this step
    meta.backend_state[BF16_PROMPTS_FROM] = 258
    assert meta.bf16_prompt_ranges() == [(60, 102), (142, 162)]


@needs_bf16
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_vector_kernel_sums_the_bf16_operands_and_a_rows_result_is_its_own(dtype):
    """A 600-token prompt's last 430 rows after 170 cached tokens (every row against fp64 with the
    query unrounded: the numerators' bf16 rounding and the query's last bits are the only
    difference), and rows alone, in other chunks or on one thread bitwise equal."""
    kc, vc = _paged(1, dtype)
    table = torch.randperm(140, generator=torch.Generator().manual_seed(2))[:38]
    lens = torch.arange(171, 601)
    tables, lens = native.paged_attention_tables(table.expand(430, -1).contiguous(), lens, 16)
    q = torch.randn(430, 9, 64, generator=torch.Generator().manual_seed(3))
    out = amx.attention(q, kc, vc, tables, lens, tiles=False)
    ref = bf16_attention_reference(q, kc.float(), vc.float(), table.tolist(), lens, query_bf16=False)
    assert (out.double() - ref).abs().max() < 1e-2  # the numerators' bf16 rounding: ~2^-9 of |v| <= 10
    fp32 = native.paged_decode_attention(q, kc, vc, tables, lens)
    assert (out - fp32).abs().max() > 0  # not the fp32 kernel's result
    for lo, hi in ((0, 1), (429, 430), (10, 43), (16, 48), (100, 357)):
        part = amx.attention(q[lo:hi], kc, vc, tables[lo:hi].contiguous(), lens[lo:hi].contiguous(), tiles=False)
        assert torch.equal(part, out[lo:hi])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(amx.attention(q, kc, vc, tables, lens, tiles=False), out)
    finally:
        torch.set_num_threads(threads)


@needs_bf16
def test_a_step_runs_its_long_prompt_rows_in_bf16_and_every_other_row_in_fp32():
    """Two decode rows and a span of 40 prompt rows at positions 240..279 (then 5 recomputed):
    rows from position 256 on take the vector kernel, the rest the fp32 one, bit for bit."""
    kc, vc = _paged(4)
    q, k, v = (torch.randn(47, n, 64, generator=torch.Generator().manual_seed(5 + n)) for n in (9, 3, 3))
    slots = torch.cat([torch.tensor([40, 81]), torch.arange(640 + 240, 640 + 285)])
    decode_tables = torch.tensor([[0, 1, 2, 0], [3, 4, 5, 6]])
    span = list(range(40, 58))
    meta = AttentionMetadata(slots, 2, decode_tables, torch.tensor([41, 50]),
                             [PrefillSpan(2, 47, 240, span, prompt_rows=40)], 16)
    backend = NativeAttentionBackend()
    backend.prepare(meta)
    meta.backend_state[BF16_PROMPTS_FROM] = 256
    assert meta.bf16_prompt_ranges() == [(18, 42)]
    out = backend.forward(q, k, v, kc, vc, meta)
    st = meta.backend_state
    fp32 = native.paged_decode_attention(q, kc, vc, st["tables"], st["lens"], checked=True)
    bf16 = amx.attention(q[18:42], kc, vc, st["tables"][18:42].contiguous(), st["lens"][18:42].contiguous(),
                         tiles=False)
    assert torch.equal(out[:18], fp32[:18]) and torch.equal(out[42:], fp32[42:])
    assert torch.equal(out[18:42], bf16) and not torch.equal(bf16, fp32[18:42])


@needs_bf16
def test_the_engine_answers_a_long_prompt_the_same_alone_batched_chunked_preempted_and_cached(smollm, make_engine,
                                                                                            monkeypatch):
    """The default model under "auto": a 700-token prompt's rows past BF16_ATTENTION_FROM (128) attend in bf16,
    in the one-call C step (a spy on its steps sees them) and in the Python layer loop (a spy
    on its kernel does), with the same greedy tokens; the same alone, beside others, in 64-token
    chunks, preempted in a cache too small for all, and again from the prefix cache."""
    loaded, tok = smollm
    if loaded.model.prompt_rows is not None:
        pytest.skip("this CPU runs prompt rows on AMX tiles (their attention too)")
    assert loaded.model.bf16_prompts_from == BF16_ATTENTION_FROM
    seen, native_rows, real_attention, real_usable = [], [], amx.attention, native_step.usable

    def spy(q, *a, **kw):
        seen.append(q.shape[0])
        return real_attention(q, *a, **kw)

    def usable(model, kv, meta, *a, **kw):
        ok = real_usable(model, kv, meta, *a, **kw)
        native_rows.extend(hi - lo for lo, hi in meta.bf16_prompt_ranges() if ok)
        return ok

    monkeypatch.setattr(amx, "attention", spy)
    monkeypatch.setattr(native_step, "usable", usable)
    g = torch.Generator().manual_seed(9)
    long = torch.randint(200, 30000, (700,), generator=g).tolist()
    others = [torch.randint(200, 30000, (n,), generator=g).tolist() for n in (40, 300)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    def engine(kv: int, budget: int, seqs: int):
        return make_engine(tiny=False, loaded=loaded, tokenizer=tok, kv_cache_memory=kv,
                           max_num_batched_tokens=budget, max_num_seqs=seqs)

    big = engine(64 << 20, 1024, 64)
    alone = big.generate([long], params)[0]
    assert sum(native_rows) == 700 - BF16_ATTENTION_FROM and not seen  # its rows past 128, in the C step
    python = engine(64 << 20, 1024, 64)
    monkeypatch.setattr(loaded.model, "native_decode", None)  # the Python layer loop (after the engine set it)
    assert python.generate([long], params)[0] == alone
    assert sum(seen) == loaded.config.num_hidden_layers * (700 - BF16_ATTENTION_FROM)  # each layer, its rows past 128
    assert_engine_clean(python)
    monkeypatch.undo()
    alone_others = [big.generate([p], params)[0] for p in others]
    assert big.generate([long], params)[0] == alone and big.blocks.num_cached_blocks > 0  # from the prefix cache
    assert_engine_clean(big)
    fresh = engine(64 << 20, 1024, 64)
    assert fresh.generate([others[0], long, others[1]], params) == [alone_others[0], alone, alone_others[1]]
    assert_engine_clean(fresh)
    chunked = engine(64 << 20, 64, 64)  # 64-row steps
    assert chunked.generate([long, others[1]], params) == [alone, alone_others[1]]
    assert_engine_clean(chunked)
    small = engine(20 << 20, 256, 8)  # ~870 tokens of bf16 KV for ~1,100 wanted: preemption
    assert small.generate([others[1], long, others[0]], params) == [alone_others[1], alone, alone_others[0]]
    assert small.scheduler.preemptions["memory"] > 0
    assert_engine_clean(small)
