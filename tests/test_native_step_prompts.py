"""Prompt rows in the one-call C step (engine/model/native_step.py): a step whose rows include
small prompt chunks or speculative drafts (consecutive positions of one sequence, up to
MAX_ROWS_WITH_PROMPTS rows) runs natively with bitwise the Python path's hidden states and
K/V; a larger one takes the Python path. Through the engine: chunked prompts and prompt-lookup
speculation give the same tokens with the C step on and off, and every block is back."""
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


def _mixed_meta(decode_lens, decode_tables, spans):
    """Decode rows first (each at position len - 1), then each (start, n, table) chunk."""
    slots = [t[(n - 1) // BS] * BS + (n - 1) % BS for n, t in zip(decode_lens, decode_tables)]
    prefills, row = [], len(decode_lens)
    for start, n, table in spans:
        slots += [table[p // BS] * BS + p % BS for p in range(start, start + n)]
        prefills.append(PrefillSpan(row, row + n, start, table))
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


def test_a_step_with_many_prompt_rows_takes_the_python_path(model):
    layers = [(torch.zeros(8, BS, 3, 64), torch.zeros(8, BS, 3, 64))]
    n = native_step.MAX_ROWS_WITH_PROMPTS
    assert native_step.usable(model, layers, _mixed_meta([5], [[1]], [(0, n - 1, [2, 3, 4, 5])]), None)
    assert not native_step.usable(model, layers, _mixed_meta([5], [[1]], [(0, n, [2, 3, 4, 5])]), None)


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
