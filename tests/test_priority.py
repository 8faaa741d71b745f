"""Priorities and tenant fairness in the engine's queue, without a network: the order waiting
requests are admitted in, preemption of lower-priority work when the batch or the KV is full
(and the preempted request resuming token-exact), and fair shares among tenants."""
from __future__ import annotations

import pytest

from pdserve.common.errors import InvalidRequestError
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.core.block_manager import BlockManager
from pdserve.engine.config import SchedulerConfig
from pdserve.engine.core.request import Request, RequestStatus
from pdserve.engine.core.scheduler import Scheduler
from pdserve.engine.core.waiting import WaitingQueue


def make(num_blocks=32, bs=4, max_seqs=4, budget=64):
    return Scheduler(SchedulerConfig(max_seqs, budget, 0), BlockManager(num_blocks, bs))


def req(rid, n, priority=0, tenant="", max_tokens=4, start=0):
    params = SamplingParams(max_tokens=max_tokens, priority=priority, tenant=tenant)
    return Request(rid, list(range(start, start + n)), params, max_tokens)


def step(sched):
    out = sched.schedule()
    for c in out.chunks:
        done = c.completes
        c.request.num_computed_tokens += c.num_new_tokens
        if done:
            c.request.append_output(1000 + len(c.request.output_token_ids))
            if len(c.request.output_token_ids) >= c.request.max_tokens:
                sched.finish(c.request, RequestStatus.FINISHED_LENGTH)
    sched.blocks.check_invariants()
    return out


def test_waiting_order_is_priority_then_least_served_tenant_then_arrival():
    q = WaitingQueue()
    a = [req(f"a{i}", 4, tenant="A") for i in range(3)]
    b = req("b0", 4, tenant="B")
    urgent = req("u", 4, priority=-1, tenant="A")
    late = req("late", 4, priority=5)
    for r in [*a, b, late, urgent]:
        q.append(r)
    assert q.pop_head() is urgent  # priority first, whoever's it is
    q.charge("A", 10)  # A was served: B's only request goes ahead of A's earlier ones
    assert q.pop_head() is b
    assert [q.pop_head() for _ in range(3)] == a  # one tenant left: arrival order
    assert q.pop_head() is late and q.head() is None


def test_a_returning_tenant_cannot_bank_credit():
    q = WaitingQueue()
    q.charge("A", 1000)
    q.charge("B", 900)
    q.arrive("C", {"A", "B"})  # new or back after an idle spell: starts from the lowest active counter
    assert q.served["C"] == 900
    q.charge("C", 5000)
    q.arrive("C", {"A"})
    assert q.served["C"] == 5900  # never lowered


def test_a_waiting_higher_priority_request_preempts_when_the_batch_is_full():
    sched = make(max_seqs=2)
    low = [req(f"low{i}", 6, priority=5, max_tokens=8) for i in range(2)]
    for r in low:
        sched.add(r)
    step(sched)
    assert sched.running == low
    hi = req("hi", 6, priority=0, max_tokens=2)
    sched.add(hi)
    out = step(sched)
    assert out.preempted == [low[1]] and low[1].status == RequestStatus.PREEMPTED  # the most recent
    assert hi in sched.running and sched.preemptions == {"memory": 0, "priority": 1, "stopped": 0}
    while sched.num_unfinished:
        step(sched)
    assert sched.blocks.num_used_blocks == 0


def test_an_equal_or_lower_priority_request_waits_its_turn():
    sched = make(max_seqs=1)
    sched.add(first := req("first", 6, priority=1, max_tokens=6))
    step(sched)
    sched.add(req("same", 6, priority=1))
    sched.add(req("later", 6, priority=3))
    assert not step(sched).preempted and sched.running == [first]


def test_a_higher_priority_request_preempts_when_the_kv_is_full():
    sched = make(num_blocks=8, bs=4, max_seqs=8)
    big = req("big", 24, priority=2, max_tokens=8)  # 6 of the 8 blocks, growing
    sched.add(big)
    step(sched)
    hi = req("hi", 12, priority=-5, max_tokens=2, start=100)  # needs 3 blocks: only 2 are free
    sched.add(hi)
    out = step(sched)
    assert big in out.preempted and hi in sched.running
    assert sched.preemptions["priority"] == 1
    while sched.num_unfinished:
        step(sched)
    assert big.output_token_ids == [1000 + i for i in range(8)]


def test_remote_kv_admission_preempts_lower_priority_but_not_peers():
    sched = make(num_blocks=8, bs=4, max_seqs=8)
    sched.add(low := req("low", 24, priority=3, max_tokens=4))
    step(sched)
    assert not sched.add_remote(req("peer", 12, priority=3, start=200))  # as urgent: waits for blocks
    hi = req("hi", 12, priority=0, start=100)
    assert sched.add_remote(hi) and low.status == RequestStatus.PREEMPTED
    assert sched.waiting.head() is low  # back at the front, it recomputes when blocks free up
    sched.finish(hi, RequestStatus.FINISHED_ABORTED)
    while sched.num_unfinished:
        step(sched)
    assert sched.blocks.num_used_blocks == 0


def test_tenants_share_admission_fairly():
    """Tenant A floods 20 requests, tenant B sends 4 after them: with one seat at a time, B's
    requests are admitted alternately with A's, not after all of A's."""
    sched = make(max_seqs=1, budget=64)
    for i in range(20):
        sched.add(req(f"A{i}", 8, tenant="A", max_tokens=2, start=i * 8))
    for i in range(4):
        sched.add(req(f"B{i}", 8, tenant="B", max_tokens=2, start=500 + i * 8))
    order = []
    while sched.num_unfinished:
        for c in step(sched).chunks:
            if c.request.request_id not in order:
                order.append(c.request.request_id)
    b_places = [order.index(f"B{i}") for i in range(4)]
    assert max(b_places) <= 8, order  # without fairness: places 20..23
    served = sched.waiting.served
    assert abs(served["A"] - served["B"]) <= 40 or min(served.values()) == served["B"]


def test_bad_priority_and_tenant_are_refused_by_name():
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(priority=2**40).validate()
    assert e.value.param == "priority"
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(tenant="x" * 1000).validate()
    assert e.value.param == "tenant"


def test_preempted_request_resumes_token_exact(make_engine):
    """A real (tiny) model: a seeded sampled request preempted by a higher-priority one
    produces exactly what it produces alone."""
    alone = make_engine(max_num_seqs=1)
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=7, priority=4)
    want = alone.generate([[5, 6, 7, 8, 9, 10]], params)[0]
    eng = make_engine(max_num_seqs=1)
    eng.add_request("low", [5, 6, 7, 8, 9, 10], params)
    outs: dict[str, list[int]] = {"low": [], "hi": []}
    for _ in range(5):
        for o in eng.step():
            outs[o.request_id] += o.new_token_ids
    eng.add_request("hi", [11, 12, 13], SamplingParams(max_tokens=4, temperature=0, priority=0))
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id] += o.new_token_ids
    assert eng.scheduler.preemptions["priority"] == 1 and len(outs["hi"]) == 4
    assert outs["low"] == want


def test_less_urgent_prompt_chunks_wait_beside_an_urgent_request_and_stay_short_after_it(monkeypatch):
    """A long low-priority prompt takes the whole step budget alone; while an urgent request is
    here no chunk of it shares the urgent one's steps; for `urgent_window_s` after, its chunks
    are at most `yield_chunk` (the urgent client's next request finds short steps); then whole."""
    import time

    sched = Scheduler(SchedulerConfig(8, 256, 0, yield_chunk=16, urgent_window_s=30.0), BlockManager(128, 4))
    sched.add(long := req("long", 400, priority=5, max_tokens=2))
    assert [c.num_new_tokens for c in step(sched).chunks] == [256]
    sched.add(chat := req("chat", 20, priority=-1, max_tokens=4, start=1000))
    assert {c.request.request_id: c.num_new_tokens for c in step(sched).chunks} == {"chat": 20}
    while chat.status != RequestStatus.FINISHED_LENGTH:
        assert "long" not in {c.request.request_id for c in step(sched).chunks}
    assert [c.num_new_tokens for c in step(sched).chunks] == [16]  # the window: short chunks
    later = time.monotonic() + 31.0
    monkeypatch.setattr(time, "monotonic", lambda: later)
    assert max(c.num_new_tokens for c in step(sched).chunks) > 16  # the window has passed: whole chunks
    while sched.num_unfinished:
        step(sched)
    assert long.output_token_ids


def test_less_urgent_decodes_take_turns_beside_an_urgent_stream():
    sched = Scheduler(SchedulerConfig(16, 256, 0, yield_decodes=2), BlockManager(128, 4))
    low = [req(f"l{i}", 4, priority=3, max_tokens=12, start=10 * i) for i in range(5)]
    for r in low:
        sched.add(r)
    step(sched)
    assert len(step(sched).chunks) == 5  # no one more urgent: all decode together
    sched.add(chat := req("chat", 4, priority=0, max_tokens=6, start=900))
    turns = {r.request_id: 0 for r in low}
    while chat.status != RequestStatus.FINISHED_LENGTH:
        ids = [c.request.request_id for c in step(sched).chunks]
        assert "chat" in ids and len([i for i in ids if i != "chat"]) <= 2
        for i in ids:
            turns[i] = turns.get(i, 0) + 1
    assert min(turns[r.request_id] for r in low) >= 1  # in turns: none starves
    while sched.num_unfinished:
        step(sched)
    assert all(len(r.output_token_ids) == 12 for r in low)


def test_no_less_urgent_decode_joins_an_urgent_prompts_step_and_long_contexts_wait():
    """An urgent prompt's step is its time to first token: the less urgent decodes sit it out.
    Beside the urgent decodes after it, the learnt cost decides: rows whose attention reads a
    long context do not fit, short ones do."""
    sched = Scheduler(SchedulerConfig(16, 256, 0, yield_decodes=4, urgent_step_budget=0.3), BlockManager(1024, 4))
    for n, ctx in ((1, 100), (2, 200), (2, 1100), (4, 400), (4, 4000), (8, 800), (16, 16000), (32, 3200)):
        sched.cost.observe(0.002 + 0.0001 * n + 4e-6 * ctx, n, ctx)  # as test_isolation's cost model
    short = [req(f"s{i}", 8, priority=3, max_tokens=40, start=100 * i) for i in range(2)]
    long = [req(f"l{i}", 1000, priority=3, max_tokens=40, start=5000 + 2000 * i) for i in range(2)]
    for r in short + long:
        sched.add(r)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in short + long):
        step(sched)
    sched.add(chat := req("chat", 40, priority=-10, max_tokens=8, start=900))
    first = [c.request.request_id for c in step(sched).chunks]
    assert first == ["chat"]  # the prompt alone
    joined = set()
    while chat.status != RequestStatus.FINISHED_LENGTH:
        ids = [c.request.request_id for c in step(sched).chunks]
        assert "chat" in ids
        joined |= set(ids) - {"chat"}
    assert joined and joined <= {"s0", "s1"}  # short rows took turns; the long ones waited
    while sched.num_unfinished:
        step(sched)


def test_a_worker_with_less_urgent_work_lends_its_cores_to_a_peers_urgent_stream(make_engine, tmp_path):
    """Two engines of one host (engine/parallel/cores.py): while one steps for a priority -1
    stream, the other, with only priority-5 work, stands aside; both answer as alone."""
    import asyncio

    from pdserve.engine.core.async_engine import AsyncEngine
    from pdserve.engine.parallel.cores import CoreShare

    low = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True, priority=5)
    hi = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, priority=-1)
    want_low = make_engine().generate([[5, 6, 7, 8]], low)[0]
    want_hi = make_engine().generate([[9, 10, 11]], hi)[0]
    shares = [CoreShare(tmp_path, name, own_threads=1, max_threads=2, set_threads=lambda n: None)
              for name in ("flood", "chat")]
    flood, chat = (AsyncEngine(make_engine(), cores=s) for s in shares)

    async def run(ae, rid, prompt, params, started=None):
        toks = []
        async for out in ae.generate(rid, prompt, params):
            toks += out.new_token_ids
            if started is not None:
                started.set()
        return toks

    async def main():
        started = asyncio.Event()
        low_task = asyncio.ensure_future(run(flood, "low", [5, 6, 7, 8], low, started))
        await started.wait()
        got_hi = await run(chat, "hi", [9, 10, 11], hi)
        return await low_task, got_hi

    for ae in (flood, chat):
        ae.start()
    try:
        got_low, got_hi = asyncio.run(main())
    finally:
        for ae in (flood, chat):
            ae.stop()
        for s in shares:
            s.close()
    assert got_low == want_low and got_hi == want_hi
    assert shares[0].yielded_s > 0 and shares[1].yielded_s == 0


def _learnt(sched):
    for n, ctx in ((1, 100), (2, 200), (2, 1100), (4, 400), (4, 4000), (8, 800), (16, 16000), (32, 3200)):
        sched.cost.observe(0.002 + 0.0001 * n + 4e-6 * ctx, n, ctx)  # a = 2 ms, 0.1 ms a row, 4 us a key


def test_window_steps_stay_within_their_seconds_and_every_less_urgent_row_takes_its_turn(monkeypatch):
    """After an urgent request (within `urgent_window_s`), a step of only less urgent work is
    a window step: by the learnt cost it takes at most `window_step_s` (decodes of long
    contexts take turns, each step takes at least one, none starves), a prompt chunk past the
    step's first row shrinks to what fits (the first takes `yield_chunk`); once the window has passed, every row decodes in one step again."""
    import time

    sched = Scheduler(SchedulerConfig(16, 256, 0, yield_chunk=64, urgent_window_s=30.0, window_step_s=0.012),
                      BlockManager(2048, 4))
    _learnt(sched)
    flood = [req(f"a{i}", 1000, max_tokens=30, start=2000 * i) for i in range(6)]
    for r in flood:
        sched.add(r)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in flood):
        step(sched)
    assert len(step(sched).chunks) == 6  # no window yet: all decode together (a 2 + 6 x 4.1 ms step)
    sched.add(chat := req("chat", 20, priority=-10, max_tokens=3, start=30000))
    while chat.status != RequestStatus.FINISHED_LENGTH:
        step(sched)
    sched.add(late := req("late", 600, max_tokens=2, start=40000))
    turns = {r.request_id: 0 for r in flood}
    for _ in range(12):
        out = step(sched)
        assert out.chunks
        fit = sched.cost.fit()
        predicted = fit[0] + sum(sched.cost.chunk_seconds(c.num_new_tokens, c.request.num_computed_tokens
                                                          - c.num_new_tokens) for c in out.chunks)
        assert predicted <= 0.012 or len(out.chunks) == 1  # within the step's seconds, or its one row
        for c in out.chunks:
            if c.request is late and len(out.chunks) > 1:
                assert c.num_new_tokens < 64  # 64 prompt tokens at 4 us a key do not fit beside a row
            elif c.request is not late:
                turns[c.request.request_id] += 1
    assert min(turns.values()) >= 2  # in turns: none starves
    later = time.monotonic() + 31.0
    monkeypatch.setattr(time, "monotonic", lambda: later)
    assert len(step(sched).chunks) >= 6  # the window has passed: all together again
    while sched.num_unfinished:
        step(sched)
    assert all(len(r.output_token_ids) == 30 for r in flood) and late.output_token_ids


def test_a_window_step_is_bounded_by_yield_chunk_until_the_cost_is_learnt_and_a_peers_by_peer_chunk():
    """In its own window (an urgent request was here) a worker's prompt chunks take yield_chunk
    tokens while it has no cost model; in only a peer's window, peer_chunk (its step pauses
    for the peer's urgent steps at a layer's end instead)."""
    sched = Scheduler(SchedulerConfig(8, 256, 0, yield_chunk=16, peer_chunk=96, urgent_window_s=30.0),
                      BlockManager(256, 4))
    sched.note_urgency_elsewhere(-5)  # a peer steps for an urgent stream
    sched.add(long := req("long", 400, priority=0, max_tokens=2))
    assert [c.num_new_tokens for c in step(sched).chunks] == [96]
    sched.add(chat := req("chat", 8, priority=-5, max_tokens=2, start=9000))
    while chat.status != RequestStatus.FINISHED_LENGTH:
        step(sched)
    assert [(c.request, c.num_new_tokens) for c in step(sched).chunks] == [(long, 16)]  # its own window now
    with pytest.raises(ValueError, match="window_step_s"):
        SchedulerConfig(window_step_s=-1)
    with pytest.raises(ValueError, match="peer_chunk"):
        SchedulerConfig(peer_chunk=-1)


def test_only_a_long_prompt_step_offers_pauses_within_each_layer_and_at_its_end(make_engine):
    """`between_layers` (a worker's pause for a peer's urgent step) runs three times a layer in
    a step of more than PAUSE_MIN_TOKENS prompt tokens (after the attention, after the MLP's
    first matmul, at the layer's end: the peer waits for a part of a layer), not in short or
    decode-only steps (they keep the one-call C step); the tokens are those of a step without it."""
    from pdserve.engine.core.kv_hooks import PAUSE_MIN_TOKENS

    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    long, short = list(range(10, 10 + PAUSE_MIN_TOKENS + 40)), list(range(400, 420))
    want = make_engine().generate([long, short], params)
    eng = make_engine()
    calls = []
    eng.between_layers = lambda may_stop: calls.append(eng.scheduler.running[0].num_computed_tokens)
    assert eng.generate([short], params) == [want[1]] and calls == []  # 20 prompt tokens, then decodes
    assert eng.generate([long], params) == [want[0]]
    assert calls == [0] * 3 * eng.model_config.num_hidden_layers  # three times a layer, within the prompt's step


def test_a_short_last_chunk_that_streams_its_kv_out_pauses_within_each_layer_too(make_engine):
    """The step that completes a prompt whose KV streams out layer by layer (a prefill worker's
    last chunk) runs the layer loop anyway: however few its prompt tokens, it offers the pauses
    (without stopping), so a peer's urgent steps never run beside it on a lent core."""
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    short = list(range(400, 420))  # 20 prompt tokens: no pause without the stream
    want = make_engine().generate([short], params)
    eng = make_engine()
    calls, streamed = [], []
    eng.between_layers = lambda may_stop: calls.append(may_stop)
    eng.add_request("p", short, params, hold_kv=True)
    eng.stream_kv_layers("p", lambda a, b, kv: streamed.append((a, b)), group=1)
    out = []
    while eng.has_unfinished_requests():
        out += [t for o in eng.step() for t in o.new_token_ids]
    assert out == want[0]
    layers = eng.model_config.num_hidden_layers
    assert calls == [False] * 3 * layers and streamed == [(i, i + 1) for i in range(layers)]
    assert eng.export_kv("p")[0] == short  # the prompt's KV, its first token sampled as without a pause
    assert eng.release_kv("p")
