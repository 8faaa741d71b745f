"""A long step of less urgent work stops at a layer's end when a more urgent request comes
(engine/core/kv_hooks.py StepStopped, Scheduler.undo): it counts for nothing, its requests
run it again with the same results (one that took its blocks as a prefix is preempted), no
block it did not compute is left in the prefix cache, and every block comes back."""
import asyncio
import threading

import pytest

from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.core.async_engine import AsyncEngine
from pdserve.engine.core.kv_hooks import StepStopped
from pdserve.engine.core.urgency import PAUSE_MIN_TOKENS

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
        if len(calls) == 2:  # after the second layer has written its KV
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


def test_the_rule_stops_only_for_a_more_urgent_arrival(make_engine):
    ae = AsyncEngine(make_engine())
    ae._urgency = 0
    for arrived, may_stop, stops in ((-5, True, True), (-5, False, False), (0, True, False), (3, True, False),
                                     (None, True, False)):
        ae._arrived = arrived
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
