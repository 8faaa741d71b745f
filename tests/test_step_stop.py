"""A long step of less urgent work stops at a layer's end when a more urgent request comes
(engine/core/kv_hooks.py StepStopped, Scheduler.undo): it counts for nothing, its requests
run it again with the same results (one that took its blocks as a prefix is preempted), no
block it did not compute is left in the prefix cache, and every block comes back."""
import asyncio
import ctypes
import threading

import pytest
import torch

from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.core.async_engine import AsyncEngine
from pdserve.engine.core.engine import LLMEngine
from pdserve.engine.core.kv_hooks import StepStopped, StopWord
from pdserve.engine.core.urgency import PAUSE_MIN_TOKENS
from pdserve.engine.kernels import native
from pdserve.engine.kernels.native import step, w4a8
from pdserve.engine.sampling.speculative import propose

from conftest import assert_engine_clean
from test_native_step import BS, _decode_meta, _prefill, model, step_calls  # noqa: F401 (fixtures)

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
LONG = [7 + (i * 37) % 500 for i in range(PAUSE_MIN_TOKENS + 60)]  # one step over PAUSE_MIN_TOKENS
SHORT = [11, 12, 13, 14, 15]


def _tokens(outs) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {}
    for o in outs:
        got.setdefault(o.request_id, []).extend(o.new_token_ids)
    return got


def _until_done(eng) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        for rid, toks in _tokens(eng.step()).items():
            got.setdefault(rid, []).extend(toks)
    return got


def test_a_stopped_step_counts_for_nothing_and_leaves_no_block_cached(make_engine):
    want = make_engine().generate([LONG], GREEDY)[0]
    eng = make_engine()
    calls: list[bool] = []

    def stop_once(may_stop: bool) -> None:
        calls.append(may_stop)
        if len(calls) == 2:  # at the second pause point, within the first layer
            raise StepStopped("test")
    eng.between_layers = stop_once
    eng.add_request("long", LONG, GREEDY)
    assert eng.step() == [] and eng.scheduler.stopped_steps == 1 and calls == [True, True]
    req = eng.scheduler.requests["long"]
    assert req.num_computed_tokens == 0 and req in eng.scheduler.running  # it keeps its place
    # the blocks the step was to fill are not offered to anyone as a computed prefix
    assert eng.blocks.match_prefix(LONG, count=False).num_tokens == 0
    eng.blocks.check_invariants()
    eng.between_layers = None
    assert _until_done(eng)["long"] == want  # the step again, from the start: the same tokens
    assert eng.blocks.match_prefix(LONG, count=False).num_tokens > 0  # computed now: cached


def test_a_stopped_step_whose_blocks_another_request_took_preempts_that_one(make_engine):
    """Two requests of one prompt in one step: the second's prefix is the first's blocks of this
    very step (read as computed). When the step stops, the second is preempted (it finds the
    prefix again once it is computed), nothing uncomputed stays cached, and both answer as
    one alone."""
    want = make_engine().generate([LONG], GREEDY)[0]
    eng = make_engine()
    calls: list[bool] = []

    def stop_once(may_stop: bool) -> None:
        calls.append(may_stop)
        if len(calls) == 1:
            raise StepStopped("test")
    eng.between_layers = stop_once
    eng.add_request("a", LONG, GREEDY)
    eng.add_request("b", LONG, GREEDY)
    assert eng.step() == [] and calls == [True]
    assert eng.scheduler.preemptions["stopped"] == 1 and eng.scheduler.requests["b"] in eng.scheduler.waiting
    assert eng.blocks.match_prefix(LONG, count=False).num_tokens == 0
    eng.blocks.check_invariants()
    assert _until_done(eng) == {"a": want, "b": want}
    assert eng.scheduler.stopped_steps == 1


def test_a_short_step_of_the_python_layer_loop_stops_for_its_word(make_engine):
    """Two requests decode and a short prompt (under PAUSE_MIN_TOKENS) joins them: a step the
    Python layer loop runs (the native step's kind on an AMX CPU, where prompt rows take that
    loop) reads the stop word at each layer's end and stops at the first when the word is
    below its threshold: no output, no progress; then every request gives the tokens of a run
    that never stopped, and every block is back."""
    prompts = [[1, 2, 3, 4, 5, 6], [9, 8, 7, 6, 5, 4, 3, 2]]
    want = make_engine().generate([*prompts, SHORT], GREEDY)
    eng = make_engine()
    eng.stop_word = word = StopWord()
    for rid, p in zip("ab", prompts):
        eng.add_request(rid, p, GREEDY)
    got = _tokens(eng.step())
    eng.add_request("s", SHORT, GREEDY)
    computed = {r: eng.scheduler.requests[r].num_computed_tokens for r in "abs"}
    layers, hook_of = [], eng._native_stop

    def seen():  # the step's hook, recording the layers whose ends it was called at
        hook = hook_of()

        def spy(i):
            layers.append(i)
            hook(i)
        spy.native_stop = hook.native_stop
        return spy
    eng._native_stop = seen
    word.note(-5)
    assert eng.step() == [] and eng.scheduler.stopped_steps == 1
    assert layers == [0]  # it stopped at the first layer's end
    assert {r: eng.scheduler.requests[r].num_computed_tokens for r in "abs"} == computed
    word.clear()
    for rid, toks in _until_done(eng).items():
        got.setdefault(rid, []).extend(toks)
    assert [got["a"], got["b"], got["s"]] == want
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


def test_the_rule_stops_only_for_a_more_urgent_arrival(make_engine):
    ae = AsyncEngine(make_engine())
    ae.stop_word.threshold = 0
    for arrived, may_stop, stops in ((-5, True, True), (-5, False, False), (0, True, False), (3, True, False),
                                     (None, True, False)):
        ae.stop_word.clear()
        if arrived is not None:
            ae.stop_word.note(arrived)
        if stops:
            with pytest.raises(StepStopped):
                ae._between_layers(may_stop)
        else:
            ae._between_layers(may_stop)


def test_an_urgent_request_that_comes_during_a_long_step_goes_first(make_engine):
    """The long prompt's step is held at its first layer's end until the urgent request has
    been added: the step stops there, the urgent request's first token comes before the long
    prompt's, and both equal what each gives alone."""
    want_long, want_short = make_engine().generate([LONG, SHORT], GREEDY)
    eng = make_engine()
    ae = AsyncEngine(eng)
    in_step, added = threading.Event(), threading.Event()
    stop_rule = eng.between_layers

    def held(may_stop: bool) -> None:
        if not in_step.is_set():
            in_step.set()
            added.wait(10)
        stop_rule(may_stop)
    eng.between_layers = held
    ae.start()
    firsts: list[str] = []

    async def one(rid, prompt, priority):
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, priority=priority)
        out = []
        async for o in ae.generate(rid, prompt, params):
            if not out:
                firsts.append(rid)
            out.extend(o.new_token_ids)
        return out

    async def main():
        long = asyncio.ensure_future(one("long", LONG, 0))
        assert await asyncio.get_running_loop().run_in_executor(None, in_step.wait, 10)
        short = asyncio.ensure_future(one("short", SHORT, -10))
        await asyncio.sleep(0)  # its add_request has noted the arrival (before its command is queued)
        added.set()
        return await long, await short

    try:
        assert asyncio.run(main()) == (want_long, want_short)
        assert firsts == ["short", "long"] and eng.scheduler.stopped_steps == 1
    finally:
        ae.stop()


# ---- the one-call native step (engine/kernels/native/step.c) stops at a layer's end too ----

native_only = pytest.mark.skipif(not native.available() or not w4a8.available(),
                                 reason="the native step needs the native build with AVX2")


def _stop_hook(word: ctypes.c_int32, threshold: int):
    """A layer hook that only stops the step, as engine/core/kv_hooks.py gives one."""
    hook = lambda i: None
    hook.native_stop = (ctypes.addressof(word), threshold)
    return hook


@native_only
# one team (up to team_rows), rows split, split from one thread's part (the other takes rows over), per op
@pytest.mark.parametrize("rows,split", [(3, 2), (8, 2), (8, 3), (8, 0)])
def test_the_native_step_stops_after_its_first_layer_when_its_word_is_below_the_threshold(model, step_calls, rows,
                                                                                             split, monkeypatch):
    """A decode step whose stop word is already below its threshold stops at its first layer's
    end (with its rows split between the threads, each part there): the first layer's K/V of
    the new rows is in the cache, no other layer's, and nothing else changed. At or above the
    threshold it runs to the end, bitwise as without a word."""
    cfg = model.config
    assert (rows <= model.native_decode.team_rows) == (rows == 3)
    monkeypatch.setattr(model.native_decode, "split_rows", split)
    prompts = [[100 + 37 * i + j for j in range(2 + i)] for i in range(rows)]
    tables = [[1 + i] for i in range(rows)]  # each prompt and its new token in one block
    kv = torch.zeros(cfg.num_hidden_layers, 2, 1 + rows, BS, cfg.num_key_value_heads, cfg.head_dim)
    _prefill(model, prompts, kv, tables)
    lens = [len(p) + 1 for p in prompts]
    slots = [t[0] * BS + n - 1 for t, n in zip(tables, lens)]

    def decode(cache, hook):
        meta = _decode_meta(lens, tables)
        model.backend.prepare(meta)
        with torch.inference_mode():
            return model(torch.tensor([p[-1] for p in prompts]), torch.tensor([n - 1 for n in lens]),
                         [(cache[i, 0], cache[i, 1]) for i in range(cache.shape[0])], meta, hook)
    want_cache = kv.clone()
    want = decode(want_cache, None)
    word = ctypes.c_int32(-1)
    stopped = kv.clone()
    with pytest.raises(step.Stopped):
        decode(stopped, _stop_hook(word, 0))
    rows_of = lambda c: c.flatten(2, 3)  # (layers, 2, slots, heads, head_dim)
    new = rows_of(stopped)[:, :, slots]
    assert (new[0].flatten(2) != 0).any(-1).all()  # every new row's K and V of the first layer
    assert (new[1:] == 0).all()  # of no other layer
    rows_of(stopped)[:, :, slots] = 0
    assert torch.equal(stopped, kv)  # nothing else was written
    for value in (0, 5):  # at the threshold, above it
        word.value = value
        cache = kv.clone()
        assert torch.equal(decode(cache, _stop_hook(word, 0)), want) and torch.equal(cache, want_cache)
    assert step_calls == [rows] * 4  # every step ran natively


def _engine(smollm, **config) -> LLMEngine:
    loaded, tok = smollm
    return LLMEngine(loaded, EngineConfig(cache=CacheConfig(kv_cache_memory=16 << 20), **config), tok)


@native_only
def test_a_stopped_native_decode_step_counts_for_nothing(smollm, step_calls):
    """Two requests decode; their decode-only step (one C call) finds the word below its
    threshold and stops: no output, no progress, a stopped step; then the same greedy tokens
    as a run that never stopped, and every block back."""
    prompts = [[1, 2, 3, 4, 5, 6], [9, 8, 7, 6, 5, 4, 3, 2]]
    want = _engine(smollm).generate(prompts, GREEDY)
    eng = _engine(smollm)
    eng.stop_word = word = StopWord()
    for rid, p in zip("ab", prompts):
        eng.add_request(rid, p, GREEDY)
    got = _tokens(eng.step())  # the prompts (a step that may stop too: the word says go on)
    computed = [eng.scheduler.requests[r].num_computed_tokens for r in "ab"]
    word.note(-5)
    with pytest.MonkeyPatch.context() as mp:
        raised = []
        real = step.run

        def spy(*args, **kw):
            try:
                return real(*args, **kw)
            except step.Stopped:
                raised.append(args[1].shape[0])
                raise
        mp.setattr(step, "run", spy)
        assert eng.step() == [] and raised == [2]  # the decode-only step stopped in C
    assert eng.scheduler.stopped_steps == 1
    assert [eng.scheduler.requests[r].num_computed_tokens for r in "ab"] == computed
    word.clear()
    for rid, toks in _until_done(eng).items():
        got[rid].extend(toks)
    assert [got["a"], got["b"]] == want
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
    assert_engine_clean(eng)


@native_only
def test_a_native_step_that_checks_guesses_ignores_the_word(smollm, step_calls):
    """Prompt lookup: a decode step that checks guesses (a chunk of consecutive rows, one C
    call) may not stop: with the word below its threshold it runs to the end, and the tokens
    are those of a run without a word."""
    tok = smollm[1]
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Repeat exactly: the cat sat on the mat. "
                                                  "The cat sat on the mat."}]), add_special_tokens=False)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    eng = _engine(smollm, speculative_tokens=4)
    eng.stop_word = word = StopWord()
    eng.add_request("r", prompt, params)
    req, got = eng.scheduler.requests["r"], []
    while not got or not propose(req.all_token_ids, 4):  # until the next step checks guesses
        got += _tokens(eng.step()).get("r", [])
    word.note(-5)
    got += _tokens(eng.step())["r"]
    assert eng.speculator.proposed > 0 and step_calls[-1] > 1  # guesses checked, natively
    assert eng.scheduler.stopped_steps == 0
    word.clear()
    got += _until_done(eng).get("r", [])
    assert got == _engine(smollm, speculative_tokens=4).generate([prompt], params)[0]
    assert_engine_clean(eng)


@native_only
def test_an_urgent_request_stops_the_native_decode_step_it_comes_during(smollm, monkeypatch):
    """Through AsyncEngine: the first decode-only step of two requests is held before its C call
    until an urgent request has been added (its arrival written to the stop word): the C step
    stops after its first layer and counts for nothing; every request gives the tokens of a
    run that never stopped, and every block is back."""
    prompts = [[1, 2, 3, 4, 5, 6], [9, 8, 7, 6, 5, 4, 3, 2]]
    want = _engine(smollm).generate([*prompts, SHORT], GREEDY)
    eng = _engine(smollm)
    ae = AsyncEngine(eng)
    in_step, added, raised = threading.Event(), threading.Event(), []
    real = step.run

    def held(*args, **kw):
        if args[1].shape[0] == 2 and not in_step.is_set():  # the two requests' first decode-only step
            in_step.set()
            added.wait(10)
        try:
            return real(*args, **kw)
        except step.Stopped:
            raised.append(args[1].shape[0])
            raise
    monkeypatch.setattr(step, "run", held)

    async def one(rid, prompt, priority):
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, priority=priority)
        return [t async for o in ae.generate(rid, prompt, params) for t in o.new_token_ids]

    async def main():
        less = [asyncio.ensure_future(one(rid, p, 0)) for rid, p in zip("ab", prompts)]
        assert await asyncio.get_running_loop().run_in_executor(None, in_step.wait, 10)
        urgent = asyncio.ensure_future(one("u", SHORT, -10))
        await asyncio.sleep(0)  # its add_request has noted the arrival (before its command is queued)
        added.set()
        return [await t for t in less] + [await urgent]

    ae.start()
    try:
        assert asyncio.run(main()) == want
    finally:
        ae.stop()
    assert raised == [2] and eng.scheduler.stopped_steps == 1
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
