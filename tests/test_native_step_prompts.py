"""Prompt rows in the one-call C step (engine/model/native_step.py): a step whose rows include
prompt chunks or speculative drafts (consecutive positions of one sequence) runs natively with
bitwise the Python path's hidden states and K/V, small chunks over the nibble weights, large
ones over the byte weights, and rows whose attention the model gives to bf16 vectors there
too. Through the engine: chunked prompts and prompt-lookup speculation give the same tokens
with the C step on and off, and every block is back."""
from __future__ import annotations

import pytest
import torch

from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.core.engine import LLMEngine
from pdserve.engine.kernels.attention import AttentionMetadata, PrefillSpan
from pdserve.engine.model import native_step

from conftest import assert_engine_clean
from test_native_step import BS, _forward, _prefill, model, pytestmark, step_calls  # noqa: F401 (fixtures)


def _mixed_meta(decode_lens, decode_tables, spans, prompt: bool = False):
    """Decode rows first (each at position len - 1), then each (start, n, table) chunk (its
    rows prompt tokens with `prompt`)."""
    slots = [t[(n - 1) // BS] * BS + (n - 1) % BS for n, t in zip(decode_lens, decode_tables)]
    prefills, row = [], len(decode_lens)
    for start, n, table in spans:
        slots += [table[p // BS] * BS + p % BS for p in range(start, start + n)]
        prefills.append(PrefillSpan(row, row + n, start, table, n if prompt else 0))
        row += n
    width = max(len(t) for t in decode_tables)
    return AttentionMetadata(torch.tensor(slots), len(decode_lens),
                             torch.tensor([t + [0] * (width - len(t)) for t in decode_tables]),
                             torch.tensor(decode_lens), prefills, BS)


@pytest.mark.parametrize("kv", ["fp32", "bf16"])
def test_a_step_with_prompt_chunks_equals_the_python_path(model, step_calls, kv):
    """Two decode rows, a chunk after a cached prefix (crossing a block) and a fresh 3-row prompt
    in one step (rows within team_rows too: 1 decode row + a 2-row chunk), natively and in Python
    from equal caches: bitwise equal hidden states and caches."""
    cfg, dtype = model.config, {"fp32": torch.float32, "bf16": torch.bfloat16}[kv]
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, 10000, (n,), generator=g).tolist() for n in (9, 20, 14)]
    tables = [[1, 2], [3, 4, 5], [6, 7, 8]]
    cache = torch.zeros(cfg.num_hidden_layers, 2, 10, BS, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype)
    _prefill(model, prompts, cache, tables)
    fresh = torch.randint(100, 10000, (3,), generator=g).tolist()
    cases = [  # (decode lens, decode tables, chunks, their tokens)
        ([10, 21], tables[:2], [(14, 7, tables[2]), (0, 3, [9])],
         [prompts[0][-1], prompts[1][-1]] + torch.randint(100, 10000, (7,), generator=g).tolist() + fresh),
        ([10], tables[:1], [(14, 2, tables[2])], [prompts[0][-1]] + [5, 6]),  # 3 rows: one team would race
    ]
    for lens, dtabs, spans, ids in cases:
        caches = {on: cache.clone() for on in (False, True)}
        hidden = {}
        for on in (False, True):
            meta = _mixed_meta(lens, dtabs, spans)
            pos = [n - 1 for n in lens] + [p for start, n, _ in spans for p in range(start, start + n)]
            layers = [(caches[on][i, 0], caches[on][i, 1]) for i in range(cfg.num_hidden_layers)]
            assert native_step.usable(model, layers, meta, None)
            hidden[on] = _forward(model, torch.tensor(ids), torch.tensor(pos), layers, meta, on)
        assert torch.equal(hidden[True], hidden[False]), (hidden[True] - hidden[False]).abs().max()
        assert torch.equal(caches[True], caches[False])
    assert step_calls == [len(c[3]) for c in cases]


@pytest.mark.parametrize("kv", ["fp32", "bf16"])
def test_a_step_of_many_prompt_rows_equals_the_python_path(model, step_calls, kv, monkeypatch):
    """A decode row beside a 90-row chunk after a 20-token cached prefix and a fresh 30-row
    prompt (more than step.BYTE_ROWS rows: the byte weights), the chunks' rows from position 25
    on in bf16 vectors where this CPU has them (else, rows not marked as prompt, every row in fp32), natively and in
    Python from equal caches: bitwise equal hidden states and caches."""
    from pdserve.engine.kernels.native import amx, step
    bf16 = amx.vector_attention_available() and model.prompt_rows is None  # AMX CPUs: prompt rows on tiles
    monkeypatch.setattr(model, "bf16_prompts_from", 25 if bf16 else None)
    cfg, dtype = model.config, {"fp32": torch.float32, "bf16": torch.bfloat16}[kv]
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(100, 10000, (n,), generator=g).tolist() for n in (9, 20)]
    tables = [[1, 2], list(range(3, 11)), [11, 12]]
    cache = torch.zeros(cfg.num_hidden_layers, 2, 13, BS, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype)
    _prefill(model, prompts, cache, tables[:2])
    spans = [(20, 90, tables[1]), (0, 30, tables[2])]
    ids = [prompts[0][-1]] + torch.randint(100, 10000, (120,), generator=g).tolist()
    pos = [9] + [p for start, n, _ in spans for p in range(start, start + n)]
    caches, hidden = {on: cache.clone() for on in (False, True)}, {}
    for on in (False, True):
        meta = _mixed_meta([10], tables[:1], spans, prompt=bf16)  # else recomputed rows: fp32 attention
        layers = [(caches[on][i, 0], caches[on][i, 1]) for i in range(cfg.num_hidden_layers)]
        assert native_step.usable(model, layers, meta, None)
        hidden[on] = _forward(model, torch.tensor(ids), torch.tensor(pos), layers, meta, on)
        if bf16:
            assert meta.bf16_prompt_ranges() == [(6, 91), (116, 121)]
    assert torch.equal(hidden[True], hidden[False]), (hidden[True] - hidden[False]).abs().max()
    assert torch.equal(caches[True], caches[False])
    assert step_calls == [121] and 121 > step.BYTE_ROWS


def test_a_step_with_a_layer_hook_calls_it_where_the_python_loop_does(model, step_calls):
    """A prompt step with a layer hook (what a long prompt's step gets: KV streamed out, pauses
    for a peer's urgent step) runs natively, calling the hook at each layer's end, once that
    layer's K/V is in the cache and before the next layer's, and its `within` twice inside each
    layer, as the Python layer loop does: the same calls in the same order, bitwise the same
    hidden states and cache. What the hook raises stops the step there and comes out as itself."""
    cfg = model.config
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(100, 10000, (40,), generator=g)
    table = [1, 2, 3]
    cache = torch.zeros(cfg.num_hidden_layers, 2, 4, BS, cfg.num_key_value_heads, cfg.head_dim)

    def run(native_on: bool, stop_at: int | None = None):
        caches, calls = cache.clone(), []
        layers = [(caches[i, 0], caches[i, 1]) for i in range(cfg.num_hidden_layers)]

        def hook(i):
            written = [bool(caches[j, 0, 1:3].any()) for j in range(cfg.num_hidden_layers)]
            calls.append(("end", i, written.index(False) if False in written else len(written)))
            if i == stop_at:
                raise LookupError(f"stop at {i}")
        hook.within = lambda: calls.append(("within",))
        meta = _prompt_meta(table)
        saved = model.native_decode
        model.native_decode = saved if native_on else None
        try:
            model.backend.prepare(meta)
            with torch.inference_mode():
                return model(ids, torch.arange(40), layers, meta, hook), caches, calls
        finally:
            model.native_decode = saved
    (want, want_cache, want_calls), (got, got_cache, got_calls) = run(False), run(True)
    assert got_calls == want_calls and len(want_calls) == 3 * cfg.num_hidden_layers
    assert [c[2] for c in got_calls if c[0] == "end"] == list(range(1, cfg.num_hidden_layers + 1))
    assert torch.equal(got, want) and torch.equal(got_cache, want_cache)
    assert step_calls == [40]
    with pytest.raises(LookupError, match="stop at 4"):
        run(True, stop_at=4)
    assert step_calls == [40, 40]


def test_a_step_goes_on_with_the_threads_its_hook_leaves(model):
    """The worker's layer hook lends or takes back cores mid-step (cores.CoreShare.retune sets
    torch's thread count): the C step's next ops run on that count, with the same bits as a
    step on one count throughout; a hook that leaves the count keeps it."""
    from pdserve.engine.kernels.native import step
    cfg, ids, table, saved = model.config, torch.randint(100, 10000, (40,)), [1, 2, 3], torch.get_num_threads()
    cache = torch.zeros(cfg.num_hidden_layers, 2, 4, BS, cfg.num_key_value_heads, cfg.head_dim)

    def run(threads: int, switch: dict):
        caches = cache.clone()
        layers = [(caches[i, 0], caches[i, 1]) for i in range(cfg.num_hidden_layers)]

        def hook(i):
            if i in switch:
                torch.set_num_threads(switch[i])
        hook.within = lambda: None
        torch.set_num_threads(threads)
        try:
            meta = _prompt_meta(table)
            model.backend.prepare(meta)
            with torch.inference_mode():
                out = model(ids, torch.arange(40), layers, meta, hook)
            return out, caches, step.last_threads()
        finally:
            torch.set_num_threads(saved)
    base, base_cache, n = run(2, {})
    assert n == 2
    for threads, switch, last in ((2, {1: 1}, 1), (1, {0: 2, 5: 1, 9: 2}, 2)):
        got, got_cache, n = run(threads, switch)
        assert n == last and torch.equal(got, base) and torch.equal(got_cache, base_cache)


def _prompt_meta(table):
    """One fresh 40-token prompt in the blocks of `table`."""
    slots = [table[p // BS] * BS + p % BS for p in range(40)]
    none = torch.zeros(0, dtype=torch.long)
    return AttentionMetadata(torch.tensor(slots), 0, none.view(0, 1), none, [PrefillSpan(0, 40, 0, table, 40)], BS)


def test_bf16_ranges_that_are_not_a_step_s_rows_are_refused(model):
    from pdserve.engine.kernels.native import step
    w = model.native_decode
    layers = [(torch.zeros(8, BS, 3, 64), torch.zeros(8, BS, 3, 64))] * len(w.layers)
    h, pos = torch.zeros(4, w.hidden), torch.arange(4)
    tables, lens = torch.ones(4, 1, dtype=torch.long), torch.arange(1, 5)
    for rows in ([(2, 1)], [(0, 5)], [(2, 4), (0, 1)], [(0, 2)]):
        with pytest.raises(ValueError, match="ascending"):
            step.run(w, h, layers, pos, model.rotary.cos, model.rotary.sin, pos, tables, lens,
                     one_team=rows == [(0, 2)], bf16_rows=rows)  # the last: valid ranges, one team


def test_chunked_prompts_and_prompt_lookup_give_the_same_tokens_natively(smollm, step_calls):
    """Prompts in 16-token chunks beside decoding requests, then greedy decoding with prompt
    lookup (5 guesses checked per step) on text that repeats itself: the same tokens with the C
    step on and off; steps with prompt rows ran natively; every block back."""
    loaded, tok = smollm
    text = "The cat sat on the mat. The dog sat on the log. " * 6
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": f"Repeat exactly: {text}"}]),
                          add_special_tokens=False), tok.encode("Count: 1 2 3 4 5 6 7 8 9 10 11 12", add_special_tokens=False)]
    outs = {}
    for on in (True, False):
        eng = LLMEngine(loaded, EngineConfig(cache=CacheConfig(kv_cache_memory=16 << 20), speculative_tokens=5,
                                             scheduler=SchedulerConfig(max_num_batched_tokens=16)), tok)
        saved = loaded.model.native_decode
        if not on:
            loaded.model.native_decode = None
        try:
            outs[on] = eng.generate(prompts, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
            proposed = eng.speculator.proposed
        finally:
            loaded.model.native_decode = saved
        assert_engine_clean(eng)
        if on:
            native_rows = list(step_calls)
    assert outs[True] == outs[False] and all(len(o) == 40 for o in outs[True])
    assert proposed > 0  # guesses were checked
    assert any(n > len(prompts) for n in native_rows)  # steps with prompt or draft rows ran natively
