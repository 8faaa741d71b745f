"""Less urgent commands wait out a more urgent request's steps (engine/core/held_commands.py):
the rule alone, then on a real engine thread (AsyncEngine) with the tiny model."""
import asyncio
import threading

from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.core.async_engine import AsyncEngine
from pdserve.engine.core.held_commands import Command, HeldCommands


def cmd(name: str, priority=None, request_id=None, at: float = 0.0) -> Command:
    return Command(fn=name, fut=None, priority=priority, request_id=request_id, queued_at=at)


def names(cmds) -> list:
    return [c.fn for c in cmds]


def step_log(ae: AsyncEngine) -> list[tuple[set, set]]:
    """For each step of `ae`'s engine, in order: the requests added to it by then, and those
    the step produced outputs for (read on the engine thread: the engine's order, not the
    asyncio consumers')."""
    log: list[tuple[set, set]] = []
    step = ae.engine.step

    def logged():
        present = set(ae.engine.scheduler.requests)
        outs = step()
        log.append((present, {o.request_id for o in outs}))
        return outs
    ae.engine.step = logged
    return log


async def queued_while_urgent(ae: AsyncEngine, urgent: SamplingParams, start, probe=None) -> tuple:
    """Start an urgent stream, then, with the engine thread held between two of its steps,
    `start()` (a coroutine to run as a task: its first command is queued meanwhile) and, behind
    it, `probe` (a command that names no request, if given); the urgent stream's task, that
    one's and the probe's future, once they are queued and the engine thread goes on.
    The gate makes the order certain however loaded the machine is: the command is drained
    while the urgent stream has most of its tokens to go."""
    async def stream():
        async for out in ae.generate("urgent", [5, 6, 7, 8] * 4, urgent):
            pass
        return out

    first = asyncio.ensure_future(stream())
    while not ae.engine.has_unfinished_requests():
        await asyncio.sleep(0.001)
    gate = threading.Event()
    ae.call(lambda e: gate.wait(30))  # names no request: runs at once, between two urgent steps
    task = asyncio.ensure_future(start())
    while ae._commands.qsize() == 0:  # the task's first command is queued behind the gate
        await asyncio.sleep(0.001)
    probed = ae.call(probe) if probe is not None else None
    gate.set()
    return first, task, probed


async def drain(ae: AsyncEngine, rid: str, params: SamplingParams):
    async for out in ae.generate(rid, [9, 10, 11] * 5, params):
        pass
    return out


def started(make_engine, max_wait_s: float) -> AsyncEngine:
    """A running AsyncEngine over the tiny model whose held commands become overdue after `max_wait_s`."""
    ae = AsyncEngine(make_engine())
    ae.held.max_wait_s = max_wait_s
    ae.start()
    return ae


def greedy(tokens: int, priority: int) -> SamplingParams:
    return SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, priority=priority)


async def behind_a_gate(ae: AsyncEngine, *starts) -> list:
    """With the engine thread held at a gate between two steps, start each coroutine of `starts`
    as a task, in order, each once the one before has queued its first command; then open the
    gate: their commands reach the engine thread in one gap, in that order. The tasks."""
    gate, gated = threading.Event(), threading.Event()
    ae.call(lambda e: (gated.set(), gate.wait(30)))
    await asyncio.to_thread(gated.wait, 30)
    tasks = []
    for k, start in enumerate(starts, 1):
        tasks.append(asyncio.ensure_future(start()))
        while ae._commands.qsize() < k:
            await asyncio.sleep(0.001)
    gate.set()
    return tasks


def test_a_command_less_urgent_than_the_engines_work_is_held_and_runs_once_nothing_outranks_it():
    h = HeldCommands(max_wait_s=1.0)
    assert not h.hold(cmd("urgent add", -10, "b"), urgency=-10)
    assert not h.hold(cmd("stats"), urgency=-10)  # names no priority: never held for its own sake
    assert not h.hold(cmd("import", 0, "a"), urgency=None)  # nothing steps: runs at once
    assert h.hold(cmd("import", 0, "a", at=0.0), urgency=-10)
    assert names(h.due(urgency=-10, now=0.5, idle=False)) == []
    assert names(h.due(urgency=0, now=0.6, idle=False)) == ["import"]  # the urgent request finished
    assert len(h) == 0 and h.held == 1 and abs(h.held_s - 0.6) < 1e-9


def test_a_requests_commands_keep_their_order_behind_its_held_one():
    h = HeldCommands(max_wait_s=1.0)
    assert h.hold(cmd("add a", 0, "a"), urgency=-10)
    assert h.hold(cmd("abort a", None, "a"), urgency=-10)  # its abort must not overtake its add
    assert not h.hold(cmd("abort c", None, "c"), urgency=-10)  # another request's: runs now
    assert names(h.due(urgency=None, now=0.1, idle=False)) == ["add a", "abort a"]
    assert not h.hold(cmd("abort a", None, "a"), urgency=-10)  # nothing of a's held any more


def test_overdue_commands_run_one_a_gap_while_the_urgent_work_goes_on():
    h = HeldCommands(max_wait_s=0.25)
    for i in range(3):
        assert h.hold(cmd(f"import {i}", 0, f"a{i}", at=0.0), urgency=-10)
    assert names(h.due(urgency=-10, now=0.2, idle=False)) == []
    assert names(h.due(urgency=-10, now=0.3, idle=False)) == ["import 0"]
    assert names(h.due(urgency=-10, now=0.31, idle=False)) == ["import 1"]
    # the engine has nothing it can step (all waiting on memory or on KV): every one runs
    assert names(h.due(urgency=-10, now=0.32, idle=True)) == ["import 2"]


def test_a_less_urgent_add_waits_for_the_urgent_stream_to_end(make_engine):
    """Beside an urgent stream a less urgent request's add is held (it is added only after the
    urgent stream's last step), while a command that names no priority still runs at once."""
    ae = started(make_engine, max_wait_s=60.0)  # the rule, not the bound: nothing runs early for being overdue
    urgent = greedy(200, -10)
    later = greedy(4, 0)
    steps = step_log(ae)

    async def main():
        u, f, probed = await queued_while_urgent(ae, urgent, lambda: drain(ae, "flood", later),
                                                 probe=lambda e: "urgent" in e.scheduler.requests)
        return await asyncio.gather(u, f), await asyncio.wrap_future(probed)

    try:
        (u, f), probe_saw_urgent = asyncio.run(main())
        assert u.finished and f.finished
        assert not [i for i, (present, out) in enumerate(steps) if "flood" in present and "urgent" in out], \
            "the less urgent add ran between the urgent stream's steps"
        assert ae.held.held == 1
        assert probe_saw_urgent  # a command that names no priority ran at once, not behind the held add
        assert ae.held.held_s > 0
    finally:
        ae.stop()


def test_an_overdue_add_joins_a_long_urgent_stream(make_engine):
    """`max_wait_s` bounds the wait: a long urgent stream does not starve a less urgent add."""
    ae = started(make_engine, max_wait_s=0.0)
    urgent = greedy(300, -10)
    later = greedy(2, 0)
    steps = step_log(ae)

    async def main():
        u, f, _ = await queued_while_urgent(ae, urgent, lambda: drain(ae, "flood", later))
        await asyncio.gather(u, f)

    try:
        asyncio.run(main())
        assert ae.held.held == 1
        # added between the urgent stream's steps, before its end
        assert any("flood" in present and "urgent" in out for present, out in steps)
    finally:
        ae.stop()


def test_a_client_gone_while_its_add_is_held_leaves_nothing_behind(make_engine):
    """Cancelled while its add waits: the add is dropped and its abort (held behind it, in the
    request's order) finds nothing; every block is back once the urgent stream ends."""
    eng = make_engine()
    ae = AsyncEngine(eng)
    ae.held.max_wait_s = 60.0
    ae.start()
    urgent = greedy(400, -10)

    async def main():
        u, gone, _ = await queued_while_urgent(ae, urgent, lambda: drain(ae, "gone", SamplingParams(max_tokens=50)))
        while not len(ae.held) and not u.done():
            await asyncio.sleep(0.001)
        held = len(ae.held)
        gone.cancel()
        await u
        for _ in range(500):
            if await ae.run(lambda e: not e.has_unfinished_requests() and e.blocks.num_used_blocks == 0):
                return held, True
            await asyncio.sleep(0.01)
        return held, False

    try:
        held, clean = asyncio.run(main())
        assert held == 1 and clean
        assert ae.held.held == 2  # the add and, behind it, the abort
    finally:
        ae.stop()


def test_a_less_urgent_command_queued_just_ahead_of_an_urgent_add_waits_for_its_steps(make_engine):
    """Commands queued together are held against the most urgent of them too: a flood's add
    (or KV import) that reaches the engine thread in the same gap as an urgent request's add,
    ahead of it, does not run before the urgent request's first step (it would add its own
    time to that request's first token); it joins once the urgent stream has ended."""
    ae = started(make_engine, max_wait_s=60.0)  # the rule, not the bound
    background = greedy(400, 0)
    urgent = greedy(8, -10)
    later = greedy(2, 0)
    steps = step_log(ae)

    async def main():
        bg = asyncio.ensure_future(drain(ae, "background", background))  # the engine steps for priority 0
        while not ae.engine.has_unfinished_requests():
            await asyncio.sleep(0.001)
        # the flood's add, then the urgent add, in one gap between two steps of the background
        await asyncio.gather(*await behind_a_gate(ae, lambda: drain(ae, "flood", later),
                                                  lambda: drain(ae, "urgent", urgent)))
        bg.cancel()
        await asyncio.gather(bg, return_exceptions=True)

    try:
        asyncio.run(main())
        first_urgent = next(i for i, (present, _) in enumerate(steps) if "urgent" in present)
        assert "flood" not in steps[first_urgent][0], "the less urgent add ran ahead of the urgent one's first step"
        assert not [i for i, (present, out) in enumerate(steps) if "flood" in present and "urgent" in out]
        assert ae.held.held >= 1
    finally:
        ae.stop()


def test_an_idle_engine_given_urgent_work_does_not_run_the_held_commands_first(make_engine):
    """An idle engine (nothing to step) runs every held command at once; but when the gap's
    commands just gave it urgent work (an urgent add, then a less urgent one held behind it), it
    is idle no longer: the held add waits for the urgent request's steps."""
    ae = started(make_engine, max_wait_s=60.0)
    urgent = greedy(8, -10)
    later = greedy(2, 0)
    steps = step_log(ae)

    async def main():  # the idle engine's next gap: the urgent add, then the less urgent one
        await asyncio.gather(*await behind_a_gate(ae, lambda: drain(ae, "urgent", urgent),
                                                  lambda: drain(ae, "flood", later)))

    try:
        asyncio.run(main())
        assert steps and "flood" not in steps[0][0], "the held add ran before the urgent request's first step"
        assert not [i for i, (present, out) in enumerate(steps) if "flood" in present and "urgent" in out]
        assert ae.held.held == 1
    finally:
        ae.stop()
