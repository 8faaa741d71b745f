"""Engine behaviour on the tiny random Llama: batching, prefix caching, preemption, abort,
KV export/import, validation. Every engine is leak-checked by the make_engine fixture."""
import pytest
import torch

from pdserve.common.errors import InvalidRequestError, KVTransferError
from pdserve.common.kv_events import BlockRemoved, BlockStored
from pdserve.engine.core.request import RequestStatus
from pdserve.common.sampling_params import SamplingParams
from tests.helpers.prompts import prompts

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


def mixed_params(n):
    out = []
    for i in range(n):
        if i % 3 == 0:
            out.append(SamplingParams(max_tokens=10 + i, temperature=0.0))
        else:
            out.append(SamplingParams(max_tokens=8 + i, temperature=0.8, top_p=0.9, top_k=50 * (i % 2),
                                      seed=1000 + i, ignore_eos=True))
    return out


@pytest.mark.parametrize("kv", ["auto", "int8", "fp8"])
def test_batched_equals_alone(make_engine, kv):
    ps, params = prompts(6), mixed_params(6)
    together = make_engine(kv_cache_dtype=kv).generate(ps, params)
    alone = [make_engine(kv_cache_dtype=kv).generate([p], [sp])[0] for p, sp in zip(ps, params)]
    assert together == alone
    assert all(len(t) > 0 for t in together)


@pytest.mark.parametrize("kv", ["auto", "int8", "fp8"])
def test_chunked_prefill_equals_whole(make_engine, kv):
    ps = prompts(4, seed=1, lo=40, hi=120)
    whole = make_engine(max_num_batched_tokens=1024, kv_cache_dtype=kv).generate(ps, GREEDY)
    chunked = make_engine(max_num_batched_tokens=24, kv_cache_dtype=kv).generate(ps, GREEDY)
    capped = make_engine(long_prefill_token_threshold=7, kv_cache_dtype=kv).generate(ps, GREEDY)
    assert whole == chunked == capped


@pytest.mark.parametrize("kv", ["auto", "int8", "fp8"])
def test_prefix_cache_hit_equals_miss(make_engine, kv):
    shared = prompts(1, seed=2, lo=50, hi=50)[0]
    ps = [shared + tail for tail in ([7, 8, 9], [10, 11], [12])]
    miss = make_engine(enable_prefix_caching=False, kv_cache_dtype=kv).generate(ps, GREEDY)
    eng = make_engine(kv_cache_dtype=kv)
    first = eng.generate(ps[:1], GREEDY)
    hits_before = eng.blocks.prefix_hits
    rest = eng.generate(ps[1:], GREEDY)
    assert first + rest == miss
    assert eng.blocks.prefix_hits - hits_before >= 2 * 48  # 3 full blocks of 16 each, twice



@pytest.mark.parametrize("kv", ["auto", "int8", "fp8"])
def test_n_choices_share_the_prompt_blocks_and_each_equals_its_seed_alone(make_engine, kv):
    """What the router does for n > 1: the same prompt n times, seeds s, s+1, ...; the later
    choices read the first one's prompt blocks (8-bit codes and scales included)."""
    prompt = prompts(1, seed=9, lo=70, hi=70)[0]
    params = [SamplingParams(max_tokens=12, temperature=0.9, seed=40 + i, ignore_eos=True) for i in range(3)]
    alone = [make_engine(kv_cache_dtype=kv).generate([prompt], [p])[0] for p in params]
    eng = make_engine(kv_cache_dtype=kv)
    together = eng.generate([prompt] * 3, params)
    assert together == alone and len(set(map(tuple, together))) == 3
    assert eng.blocks.prefix_hits >= 2 * 64  # 4 full blocks of 16, read by choices 1 and 2

def test_cache_salt_isolates_prefixes_and_keeps_answers(make_engine):
    """Prompts share cached blocks only under the same salt (tenant isolation: no cache hit,
    so no TTFT difference, reveals another tenant's prompt); answers never depend on it."""
    eng = make_engine()
    p = prompts(1, seed=4, lo=50, hi=50)[0]

    def run(salt):
        hits = eng.blocks.prefix_hits
        out = eng.generate([p], SamplingParams(max_tokens=4, temperature=0, cache_salt=salt))
        return out[0], eng.blocks.prefix_hits - hits

    first, _ = run("tenant-a")
    assert run("tenant-a") == (first, 48)  # 3 full blocks of 16: shared within the salt
    assert run("tenant-b") == (first, 0)   # nothing of tenant-a's
    assert run("") == (first, 0)           # nor for the unsalted default
    assert run("") == (first, 48)


def test_min_tokens_holds_back_every_way_to_stop(make_engine):
    eng = make_engine()
    p = prompts(1, seed=5, lo=20, hi=20)[0]
    free = eng.generate([p], SamplingParams(max_tokens=12, temperature=0))[0]
    stop = free[1]  # would end the plain run at its 2nd token
    short = eng.generate([p], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop]))[0]
    held = eng.generate([p], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop], min_tokens=5))[0]
    assert short == free[:2]
    assert len(held) >= 6 and stop not in held[:5] and held[:1] == free[:1]
    assert held[-1] == stop or len(held) == 12  # past min_tokens it stops as usual


def test_prefix_hit_skips_computed_tokens(make_engine):
    eng = make_engine()
    p = prompts(1, seed=3, lo=40, hi=40)[0]
    eng.generate([p], GREEDY)
    eng.add_request("again", p + [5], SamplingParams(max_tokens=1, temperature=0))
    sched = eng.scheduler.schedule()
    assert sched.chunks[0].num_new_tokens == 41 - 32  # two cached blocks skipped
    eng.runner.execute(sched.chunks)
    for c in sched.chunks:
        c.request.num_computed_tokens += c.num_new_tokens
    eng.abort("again")


@pytest.mark.parametrize("kv", ["auto", "int8", "fp8"])
def test_preemption_gives_same_tokens(make_engine, kv):
    ps = prompts(8, seed=4, lo=20, hi=40)
    params = [SamplingParams(max_tokens=40, temperature=0.0 if i % 2 else 0.7, seed=i, ignore_eos=True)
              for i in range(8)]
    roomy = make_engine(kv_cache_dtype=kv)
    want = roomy.generate(ps, params)
    # 24 blocks of 16 tokens cannot hold 8 sequences of ~70 tokens: preemption must happen
    tight = make_engine(kv_cache_memory=24 * roomy.kv_cache.bytes_per_block, kv_cache_dtype=kv)
    assert tight.blocks.num_blocks == 24
    preempted = []
    orig = tight.scheduler._preempt
    tight.scheduler._preempt = lambda r, cause: (preempted.append(r.request_id), orig(r, cause))
    assert tight.generate(ps, params) == want
    assert preempted, "the scenario did not preempt"


def test_the_first_output_says_how_long_the_request_queued(make_engine):
    """queue_s: from add_request to the request's first scheduling. A prompt added while
    another's chunks take every step's token budget waits for them; one added to an idle
    engine hardly waits; later outputs carry none."""
    import time
    eng = make_engine(max_num_batched_tokens=16)
    long_prompt, short = prompts(1, seed=8, lo=120, hi=120)[0], prompts(1, seed=9, lo=10, hi=10)[0]
    eng.add_request("long", long_prompt, SamplingParams(max_tokens=2, temperature=0))
    eng.step()
    t_added = time.monotonic()
    eng.add_request("short", short, SamplingParams(max_tokens=2, temperature=0))
    firsts, last_long_chunk = {}, None
    while eng.has_unfinished_requests():
        began = time.monotonic()
        for o in eng.step():
            firsts.setdefault(o.request_id, o)
            if o.request_id == "long" and last_long_chunk is None:
                last_long_chunk = began  # the step that ran the long prompt's last chunk began here
    # it waited out the long prefill: scheduled no earlier than that step (whatever the load)
    assert firsts["short"].queue_s >= last_long_chunk - t_added - 0.005
    assert firsts["short"].queue_s > 5 * firsts["long"].queue_s
    eng.add_request("idle", short + [1], SamplingParams(max_tokens=3, temperature=0))
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert 0 < outs[0].queue_s < firsts["short"].queue_s and all(o.queue_s == 0 for o in outs[1:])


def test_abort_frees_blocks_at_once(make_engine):
    eng = make_engine()
    for i, p in enumerate(prompts(3, seed=5)):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    eng.step()
    eng.step()
    used = eng.blocks.num_used_blocks
    table = eng.blocks.block_table("r1")
    assert eng.abort("r1")
    assert eng.blocks.num_used_blocks == used - len(table)
    assert not eng.abort("r1")  # unknown now
    eng.add_request("waiting", [5, 6, 7], SamplingParams(max_tokens=5))
    assert eng.abort("waiting")  # aborting a queued request works too
    eng.abort("r0")
    eng.abort("r2")


def test_stop_conditions(make_engine):
    eng = make_engine()
    ref = eng.generate([[5, 6, 7]], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    # stop at a token id: finished with reason stop, that token last
    target = ref[5]
    eng.add_request("s", [5, 6, 7], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                                                   stop_token_ids=[target]))
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert outs[-1].finished and outs[-1].finish_reason == "stop" and outs[-1].stop_reason == target
    assert [o.new_token_ids[0] for o in outs] == ref[:ref.index(target) + 1]
    # max_tokens: reason length
    eng.add_request("l", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert len(outs) == 3 and outs[-1].finish_reason == "length"


def test_eos_stops_unless_ignored(make_engine):
    eng = make_engine()
    ref = eng.generate([[9, 10]], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
    eng.eos_token_id = ref[4]  # pretend this token is EOS
    out = eng.generate([[9, 10]], SamplingParams(max_tokens=30, temperature=0))[0]
    assert out == ref[:ref.index(ref[4]) + 1]


def test_seed_reproducible_and_different_seeds_differ(make_engine):
    eng = make_engine()
    p = [[11, 12, 13]]
    sp = lambda s: SamplingParams(max_tokens=20, temperature=1.0, seed=s, ignore_eos=True)
    a, b, c = eng.generate(p, sp(1)), eng.generate(p, sp(1)), eng.generate(p, sp(2))
    assert a == b and a != c


@pytest.mark.parametrize("kv", ["auto", "int8", "fp8"])
def test_kv_export_import_matches_single_engine(make_engine, kv):
    """The disaggregation hook: prefill on one engine, ship blocks, decode on another."""
    ps = prompts(3, seed=6, lo=20, hi=50)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    expected = make_engine(kv_cache_dtype=kv).generate(ps, params)
    prefill, decode = make_engine(kv_cache_dtype=kv), make_engine(kv_cache_dtype=kv)
    for i, p in enumerate(ps):
        rid = f"pd{i}"
        prefill.add_request(rid, p, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True), hold_kv=True)
        first = None
        while prefill.has_unfinished_requests():
            for o in prefill.step():
                first = o.new_token_ids[0]
        tokens, kv = prefill.export_kv(rid)
        assert tokens == p
        assert prefill.release_kv(rid)
        dest = decode.add_remote_request(rid, p, params)
        assert len(dest) == (len(p) + 15) // 16
        assert decode.scheduler.requests[rid].status == RequestStatus.WAITING_FOR_REMOTE_KV
        decode.import_kv(rid, kv, first)
    got = {}
    while decode.has_unfinished_requests():
        for o in decode.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert [[e[0]] + got[f"pd{i}"] for i, e in enumerate(expected)] == expected


def test_kv_import_rejects_wrong_shape(make_engine):
    eng = make_engine()
    dest = eng.add_remote_request("x", [1, 2, 3, 4], SamplingParams(max_tokens=2))
    with pytest.raises(KVTransferError, match="shape"):
        eng.import_kv("x", torch.zeros(2, 2, len(dest) + 1, 16, 2, 16), 5)
    with pytest.raises(KVTransferError):
        eng.export_kv("x")
    eng.abort("x")


def test_events_follow_block_lifecycle(make_engine):
    events = []
    eng = make_engine(listener=events.append, kv_cache_memory=6 * 2 * 2 * 16 * 2 * 16 * 4)
    eng.generate([list(range(3, 40))], SamplingParams(max_tokens=1, temperature=0))
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert len(stored) == 2  # 37 prompt tokens: two full blocks
    eng.generate([list(range(100, 190))], SamplingParams(max_tokens=1, temperature=0))
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert {e.block_hash for e in removed} <= {e.block_hash for e in stored}
    assert [e.seq for e in events] == list(range(1, len(events) + 1))


@pytest.mark.parametrize("kwargs, param", [
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=-3), "max_tokens"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(temperature=-1), "temperature"),
    (dict(top_k=-1), "top_k"), (dict(min_p=2.0), "min_p"), (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(repetition_penalty=1e-45), "repetition_penalty"),
    (dict(logprobs=99), "logprobs"),
    (dict(stop_token_ids=[10_000]), "stop_token_ids"), (dict(seed=-1), "seed"),
])
def test_invalid_params_raise_named_error(make_engine, kwargs, param):
    eng = make_engine()
    with pytest.raises(InvalidRequestError) as e:
        eng.add_request("bad", [1, 2, 3], SamplingParams(**kwargs))
    assert e.value.param == param and param in str(e.value)


def test_tiny_temperature_is_greedy_not_nan(make_engine):
    """Found by fuzzing the API: temperature 1e-45 overflowed the logits to inf and NaN
    probabilities picked token 0, served as a success."""
    ps = prompts(2, seed=5)
    greedy = make_engine().generate(ps, SamplingParams(max_tokens=8, temperature=0.0))
    assert make_engine().generate(ps, SamplingParams(max_tokens=8, temperature=1e-45, seed=1)) == greedy


def test_invalid_prompts_raise_named_error(make_engine):
    eng = make_engine()
    cases = [([], "empty"), ([1, 2, 99999], "outside the vocabulary"), ([1, -1], "outside the vocabulary"),
             ([1] * 1024, "context length")]
    for prompt, msg in cases:
        with pytest.raises(InvalidRequestError, match=msg):
            eng.add_request("bad", prompt, SamplingParams())
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        eng.add_request("bad", [1] * 1000, SamplingParams(max_tokens=100))
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        eng.add_request("bad", "text needs a tokenizer", SamplingParams())
    eng.add_request("dup", [1, 2], SamplingParams(max_tokens=1))
    with pytest.raises(InvalidRequestError, match="already in use"):
        eng.add_request("dup", [1, 2], SamplingParams(max_tokens=1))
    eng.abort("dup")


def test_logprobs_are_log_softmax_of_logits(make_engine):
    eng = make_engine()
    eng.add_request("lp", [4, 5, 6], SamplingParams(max_tokens=2, temperature=0, logprobs=3, ignore_eos=True))
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    for o in outs:
        lp = o.logprobs[0]
        assert lp.top[0][0] == lp.token_id  # greedy picks the top token
        assert lp.logprob == pytest.approx(lp.top[0][1])
        assert len(lp.top) == 3 and lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]
        assert lp.logprob <= 0


def test_resume_continues_like_an_uninterrupted_run(make_engine):
    """Migration: a request re-added with the tokens it already produced continues exactly."""
    p = prompts(1, seed=9, lo=30, hi=30)[0]
    for params in (SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
                   SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=3, ignore_eos=True,
                                  presence_penalty=0.5)):
        full = make_engine().generate([p], params)[0]
        other = make_engine()
        other.add_request("m", p, params, resume=full[:7])
        rest = []
        while other.has_unfinished_requests():
            for o in other.step():
                rest += o.new_token_ids
        assert full[:7] + rest == full
    with pytest.raises(InvalidRequestError, match="nothing left"):
        make_engine().add_request("x", p, SamplingParams(max_tokens=3), resume=[5, 6, 7])
