"""Scheduler + block manager without a model: budgets, chunking, order, preemption, and a
property test over random add/abort/step interleavings (no leak, exact accounting)."""
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.core.block_manager import BlockManager
from pdserve.engine.config import SchedulerConfig
from pdserve.engine.core.request import Request, RequestStatus
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.core.scheduler import Scheduler


def make(num_blocks=16, bs=4, max_seqs=4, budget=16, threshold=0):
    bm = BlockManager(num_blocks, bs)
    return Scheduler(SchedulerConfig(max_seqs, budget, threshold), bm), bm


def req(rid, n, max_tokens=4, start=0):
    return Request(rid, list(range(start, start + n)), SamplingParams(max_tokens=max_tokens), max_tokens)


def run_step(sched):
    """What the engine does around the model: advance progress, append a token on completion."""
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


def test_chunked_prefill_under_budget_then_decode():
    sched, _ = make(budget=16)
    r = req("a", 40)
    sched.add(r)
    sizes = [[c.num_new_tokens for c in run_step(sched).chunks] for _ in range(4)]
    assert sizes == [[16], [16], [8], [1]]
    assert r.status == RequestStatus.DECODING and len(r.output_token_ids) == 2


def test_long_prefill_threshold_caps_chunks():
    sched, _ = make(budget=64, threshold=10)
    sched.add(req("a", 25))
    assert [c.num_new_tokens for c in run_step(sched).chunks] == [10]


def test_running_before_waiting_and_max_num_seqs():
    sched, _ = make(num_blocks=64, max_seqs=2, budget=32)
    for i in range(3):
        sched.add(req(f"r{i}", 8, max_tokens=3, start=100 * i))
    out = run_step(sched)
    assert [c.request.request_id for c in out.chunks] == ["r0", "r1"]  # r2 waits: 2 seqs max
    out = run_step(sched)
    assert [(c.request.request_id, c.num_new_tokens) for c in out.chunks] == [("r0", 1), ("r1", 1)]
    while sched.num_unfinished:
        run_step(sched)
    assert sched.blocks.num_used_blocks == 0


def test_preemption_takes_the_newest_and_requeues_it_first():
    sched, bm = make(num_blocks=6, bs=4, max_seqs=4, budget=64)
    a, b = req("a", 8, max_tokens=12), req("b", 8, max_tokens=12, start=50)
    sched.add(a)
    sched.add(b)
    run_step(sched)  # both prefilled (2 blocks each); at 13 tokens each needs a 4th: 8 > 6
    preempted = []
    for _ in range(6):
        preempted += run_step(sched).preempted
    assert preempted and preempted[0] is b
    assert sched.waiting.head() is b and b.num_computed_tokens == 0 and b.status == RequestStatus.PREEMPTED
    assert bm.block_table("b") == []
    while sched.num_unfinished:
        run_step(sched)
    assert len(a.output_token_ids) == 12 and len(b.output_token_ids) == 12
    assert b.num_preemptions >= 1 and bm.num_used_blocks == 0


def test_prefix_hit_counts_as_computed_at_admission():
    sched, _ = make(num_blocks=32, budget=64)
    sched.add(req("a", 13, max_tokens=1))
    run_step(sched)
    b = req("b", 13, max_tokens=1)
    sched.add(b)
    out = run_step(sched)
    assert b.num_cached_tokens == 12 and out.chunks[0].num_new_tokens == 1


def test_waiting_request_blocked_by_memory_keeps_order():
    sched, _ = make(num_blocks=4, bs=4, budget=64)
    sched.add(req("big", 14, max_tokens=1))
    sched.add(req("huge", 20, max_tokens=1, start=30))  # needs 5 blocks: never fits alongside
    sched.add(req("small", 2, max_tokens=1, start=60))
    out = run_step(sched)
    assert [c.request.request_id for c in out.chunks] == ["big"]  # small does not jump the queue


def test_remote_kv_request_joins_batch_when_ready():
    sched, bm = make(num_blocks=8)
    r = req("remote", 9, max_tokens=3)
    assert sched.add_remote(r)
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KV and len(bm.block_table("remote")) == 3
    assert run_step(sched).chunks == []  # not scheduled while its KV is in flight
    r.append_output(5)
    sched.remote_kv_ready(r)
    assert r.status == RequestStatus.DECODING
    assert [c.num_new_tokens for c in run_step(sched).chunks] == [1]
    sched.finish(r, RequestStatus.FINISHED_ABORTED)
    assert bm.num_used_blocks == 0


def test_requests_whose_kv_is_on_its_way_hold_their_seats_in_the_batch():
    """max_num_seqs counts remote requests from admission: neither a local request nor
    another remote one takes the seat, and the batch never outgrows the limit when the KV
    lands (it used to, and the scheduler's assertion stopped the engine thread)."""
    sched, bm = make(num_blocks=16, max_seqs=2)
    local = req("local", 3, max_tokens=8)
    sched.add(local)
    run_step(sched)
    remote = req("remote", 5, max_tokens=3, start=100)
    assert sched.add_remote(remote)
    assert not sched.add_remote(req("late", 5, start=200))  # no seat left: refused, nothing allocated
    sched.add(req("waits", 3, start=300))
    run_step(sched)
    assert [r.request_id for r in sched.running] == ["local"] and len(sched.waiting) == 1
    remote.append_output(5)
    sched.remote_kv_ready(remote)
    run_step(sched)
    assert len(sched.running) == 2
    for r in list(sched.requests.values()):
        sched.finish(r, RequestStatus.FINISHED_ABORTED)
    assert bm.num_used_blocks == 0


def test_a_prompt_waiting_for_its_turn_does_not_hold_up_kv_hand_offs_it_leaves_room_for():
    """A decode worker prefilling prompts itself keeps some waiting for the token budget; the
    KV hand-offs arriving meanwhile are admitted while the blocks and seats those prompts will
    need stay free, and refused once they would take them."""
    sched, bm = make(num_blocks=12, bs=4, max_seqs=4, budget=8)
    sched.add(req("local", 16, start=0))
    run_step(sched)  # its first chunk: 2 of its 4 blocks taken
    sched.add(waits := req("waits", 8, start=100))  # 2 blocks, once the budget lets it in
    assert list(sched.waiting) == [waits]
    assert sched.add_remote(first := req("remote", 12, start=200))  # 3 of 10 free: 7 left, 2 needed
    assert not sched.add_remote(req("greedy", 24, start=300))  # 6 blocks: 7 free cannot hold them and 2
    assert sched.add_remote(seat := req("seat", 4, start=400))  # 3 of 4 seats taken
    assert not sched.add_remote(req("late", 4, start=500))  # the last seat is the waiting prompt's
    assert len(bm.block_table("remote")) == 3 and not {"greedy", "late"} & set(sched.requests)
    for r in (first, seat, waits, sched.requests["local"]):
        sched.finish(r, RequestStatus.FINISHED_ABORTED)
    assert bm.num_used_blocks == 0


def land(sched, r) -> None:
    """What the engine does when a request's KV arrives: it joins the batch with the first
    token the prefill side sampled, and ends there if that was its last."""
    sched.remote_kv_ready(r)
    r.append_output(7)
    if len(r.output_token_ids) >= r.max_tokens:
        sched.finish(r, RequestStatus.FINISHED_LENGTH)


ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 6), st.integers(0, 3)),
    st.tuples(st.just("remote"), st.integers(1, 30), st.integers(1, 6)),
    st.tuples(st.just("land"), st.integers(0, 40)),
    st.tuples(st.just("abort"), st.integers(0, 40)),
    st.tuples(st.just("step")),
), max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops, st.integers(4, 24), st.integers(1, 5), st.integers(4, 40))
def test_random_interleavings_never_leak(seq, num_blocks, max_seqs, budget):
    sched, bm = make(num_blocks=num_blocks, bs=4, max_seqs=max_seqs, budget=budget)
    added = []
    for op in seq:
        if op[0] == "add":
            _, n, mt, prefix_group = op
            if n + mt > num_blocks * 4:
                continue  # the engine rejects requests that can never fit
            r = req(f"r{len(added)}", n, mt, start=prefix_group * 1000)
            added.append(r)
            sched.add(r)
        elif op[0] == "remote":
            _, n, mt = op
            if n + mt > num_blocks * 4:
                continue  # as for local requests: never admitted by the engine
            r = req(f"r{len(added)}", n, mt, start=5000 + len(added) * 100)
            if sched.add_remote(r):
                added.append(r)
        elif op[0] == "land" and sched.remote:
            land(sched, list(sched.remote.values())[op[1] % len(sched.remote)])
        elif op[0] == "abort" and added:
            r = added[op[1] % len(added)]
            if r.request_id in sched.requests:
                sched.finish(r, RequestStatus.FINISHED_ABORTED)
        else:
            run_step(sched)
        assert all(b.ref_count >= 0 for b in bm.blocks)
        assert len(sched.running) <= sched.seats_taken() <= max_seqs
    for _ in range(10_000):
        for r in list(sched.remote.values()):  # every KV hand-off ends
            land(sched, r)
        if not sched.num_unfinished:
            break
        run_step(sched)
    assert sched.num_unfinished == 0, "requests never finished (livelock)"
    assert bm.num_used_blocks == 0
    for r in added:
        if r.status == RequestStatus.FINISHED_LENGTH:
            assert len(r.output_token_ids) == r.max_tokens
