"""Tensor parallelism (engine/parallel/tp.py): degrees are checked against the heads; each rank's slice
has the right shapes; an engine over 2 and 4 ranks (4: the KV heads replicated) gives the
single engine's logits within float tolerance and its greedy tokens, batched and chunked, with
every block back; KV moves between groups of different degrees token-exactly; a rank killed
mid-stream makes the next step raise RankFailed and the blocks still come back (the tiny
groups are the module's, started once; that kill comes last). The real SmolLM2 over 3 ranks
answers as over 1, directly and served with prefill and decode groups of different degrees;
a killed decode rank takes its group down and the stream moves to another or ends."""
import os
import signal
from dataclasses import dataclass

import pytest
import torch

from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.core.engine import LLMEngine
from pdserve.engine.model.tiny import tiny_config, tiny_llama, tiny_state_dict
from pdserve.engine.parallel.shard import check_degree, kv_heads_of, shard
from pdserve.engine.parallel.tp import ModelSource, RankFailed
from tests.helpers.engine_runs import clean, handoff, kill_rank_mid_stream, run
from tests.helpers.prompts import prompts

CONFIG = EngineConfig(cache=CacheConfig(kv_cache_memory=4 << 20), scheduler=SchedulerConfig(max_num_batched_tokens=64))


def test_a_degree_that_does_not_split_the_heads_is_refused_with_the_ones_that_do():
    smollm = tiny_config(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    for tp in (1, 3, 9):
        check_degree(smollm, tp)
    with pytest.raises(ValueError, match=r"degree 2 does not divide this model's 9 attention heads \(3 KV heads\): "
                                         r"use one of 1, 3, 9"):
        check_degree(smollm, 2)


@pytest.mark.parametrize("tp", [2, 4])
def test_each_rank_holds_its_heads_and_mlp_units(tp):
    cfg = tiny_config()  # 4 heads of 16, 2 KV heads, 128 MLP units
    state = tiny_state_dict(cfg, 0)
    q = state["model.layers.0.self_attn.q_proj.weight"]
    for rank in range(tp):
        part, local = shard(state, cfg, tp, rank)
        assert local.num_attention_heads == 4 // tp and local.intermediate_size == 128 // tp
        assert local.num_key_value_heads == (2 // tp if tp <= 2 else 1)
        assert torch.equal(part["model.layers.0.self_attn.q_proj.weight"], q.split(q.shape[0] // tp)[rank])
        kv = kv_heads_of(cfg, tp, rank)
        assert torch.equal(part["model.layers.0.self_attn.k_proj.weight"],
                           state["model.layers.0.self_attn.k_proj.weight"][kv.start * 16:kv.stop * 16])
        assert part["model.layers.0.mlp.down_proj.weight"].shape == (64, 128 // tp)
        assert torch.equal(part["model.norm.weight"], state["model.norm.weight"])  # replicated
        rows = state["model.embed_tokens.weight"].tensor_split(tp)[rank]  # vocabulary-parallel
        assert torch.equal(part["model.embed_tokens.weight"], rows) and local.vocab_size == rows.shape[0]


@pytest.fixture(scope="module")
def tp_engine():
    """tp_engine(tp) -> the module's tiny-model group of `tp` ranks (CONFIG), started once and
    shared by the tests: each leaves it as it found it (no request, every block back), and one
    that killed a rank leaves it dead: the next call starts a fresh group (one left with
    requests is replaced too, so a failure does not spread). At the end every group is shut
    down and each of its ranks has exited."""
    made, live = [], {}

    def factory(tp: int) -> LLMEngine:
        e = live.get(tp)
        if e is None or e.tp.dead_ranks() or e.has_unfinished_requests():
            e = live[tp] = LLMEngine.tensor_parallel(ModelSource(tiny_seed=0), CONFIG, tp)
            made.append(e)
        return e
    yield factory
    for e in made:
        e.shutdown()
        assert all(p.poll() is not None for p in e.tp.procs)


@pytest.mark.parametrize("tp", [2, 4])
def test_greedy_tokens_and_logprobs_equal_one_rank_batched_and_chunked(tp_engine, tp):
    ps = prompts(5, seed=11, lo=5, hi=100)  # 100 tokens over a 64-token budget: chunked prefill
    want, want_lp = run(LLMEngine(tiny_llama(0), CONFIG), ps)
    e = tp_engine(tp)
    before = e.tp.group.allreduces  # the group is the module's: count this test's steps alone
    got, got_lp = run(e, ps)
    assert got == want
    assert max(abs(a - b) for x, y in zip(got_lp, want_lp) for a, b in zip(x, y)) < 1e-4
    # per step: two per layer (two layers) and the embedding lookup
    ours = e.tp.group.allreduces - before
    assert ours > 0 and ours % (2 * 2 + 1) == 0
    vocab = tiny_config().vocab_size  # rank 0 holds its share of the vocabulary, not all of it
    assert e.runner.model.model.embed_tokens.weight.shape[0] == -(-vocab // tp) == e.runner.model.lm_head.weight.shape[0]
    clean(e)


def test_an_uneven_tied_vocabulary_and_prompt_logprobs_over_two_ranks(tp_engine):
    """509 rows split 255 + 254 (the gather pads the narrower part); the LM head is the
    embedding; prompt logprobs take several passes of a 100-token prompt in 64-token chunks."""
    over = (("vocab_size", 509), ("tie_word_embeddings", True))
    ps = [[t % 509 for t in p] for p in prompts(3, seed=5, lo=70, hi=100)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    ref = LLMEngine(tiny_llama(0, **dict(over)), CONFIG)
    e = LLMEngine.tensor_parallel(ModelSource(tiny_seed=0, tiny_overrides=over), CONFIG, 2)
    try:
        outs = {}
        for engine in (ref, e):
            for i, p in enumerate(ps):
                engine.add_request(f"u{i}", p, params)
            got = {f"u{i}": ([], None) for i in range(len(ps))}
            while engine.has_unfinished_requests():
                for o in engine.step():
                    toks, plp = got[o.request_id]
                    got[o.request_id] = (toks + o.new_token_ids, o.prompt_logprobs or plp)
            outs[engine is e] = got
            clean(engine)
        for rid, (toks, plp) in outs[False].items():
            tp_toks, tp_plp = outs[True][rid]
            assert tp_toks == toks and len(tp_plp) == len(plp) == len(ps[int(rid[1:])]) - 1
            assert max(abs(a.logprob - b.logprob) for a, b in zip(tp_plp, plp)) < 1e-4
            assert [t for t, _ in tp_plp[-1].top] == [t for t, _ in plp[-1].top]
    finally:
        e.shutdown()


def test_kv_moves_between_groups_of_different_degrees(tp_engine):
    ps = prompts(3, seed=12, lo=20, hi=70)
    want = LLMEngine(tiny_llama(0), CONFIG).generate(ps, SamplingParams(max_tokens=12, temperature=0,
                                                                        ignore_eos=True))
    two, one, four = tp_engine(2), LLMEngine(tiny_llama(0), CONFIG), tp_engine(4)
    assert two.kv_cache.layout == one.kv_cache.layout == four.kv_cache.layout  # the whole model's heads
    assert handoff(two, one, ps) == want   # prefill over 2 ranks -> decode on 1
    assert handoff(one, four, ps) == want  # 1 -> 4 (KV heads replicated there)
    assert handoff(four, two, ps) == want
    for e in (two, one, four):
        clean(e)


def test_a_rank_killed_mid_stream_raises_rank_failed_and_frees_the_blocks(tp_engine):
    e = tp_engine(4)
    kill_rank_mid_stream(e, prompts(1, seed=13, lo=30, hi=30)[0], 0)  # the ranks left were taken down at once


# "auto" rounds activations to int8 per 16: a change in the last bits of a sum (the all-reduce's
# order over 3 ranks, or the attention's vector width) moves some value across a rounding step,
# and 30 layers of that move a logprob by up to ~0.3 (measured on this prompt: 504 / 15319 at
# -1.83 / -2.16 over one rank, -1.78 / -1.85 over three). Greedy text is equal up to the first
# token where the single engine's top two are that close.
AUTO_TIE = 0.6


def _greedy_top(e, prompt, params) -> tuple[list[int], list[float], dict[int, float]]:
    """One request to the end: its tokens, the margin of its top two logprobs at each, and the
    first token's top logprobs {token: logprob}."""
    e.add_request("q", prompt, params)
    toks, margins, first = [], [], {}
    while e.has_unfinished_requests():
        for o in e.step():
            for lp in o.logprobs:
                toks.append(lp.token_id)
                margins.append(lp.top[0][1] - lp.top[1][1])
                first = first or dict(lp.top)
    return toks, margins, first


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["none", "auto"])
def test_the_real_model_over_three_ranks_answers_as_over_one(smollm, fp32, quantization):
    """fp32 weights: the same greedy tokens, logprobs within float tolerance. The default
    weights: the same greedy text up to a near-tie of the single engine's (AUTO_TIE), and the
    first token's top logprobs within it."""
    from pdserve.engine.model.weights import load_model

    tok = smollm[1]
    loaded = fp32.loaded if quantization == "none" else load_model(quantization=quantization)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
    cfg = EngineConfig(quantization=quantization, cache=CacheConfig(kv_cache_memory=16 << 20))
    params = SamplingParams(max_tokens=16, temperature=0, logprobs=3)
    want, want_margin, want_first = _greedy_top(LLMEngine(loaded, cfg, tok), prompt, params)
    e = LLMEngine.tensor_parallel(ModelSource(), cfg, 3, tok)
    try:
        got, _, got_first = _greedy_top(e, prompt, params)
        assert e.kv_cache.layout == (30, 2, 16, 3, 64) and e.loaded.config.num_attention_heads == 3
        assert e.loaded.model.quantized_matrices() == loaded.model.quantized_matrices()
        clean(e)
    finally:
        e.shutdown()
    tol = 1e-3 if quantization == "none" else AUTO_TIE
    assert max(abs(lp - got_first[t]) for t, lp in want_first.items() if t in got_first) < tol
    assert len(set(want_first) & set(got_first)) >= 2  # the same leading candidates
    same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
    assert same == len(want) or want_margin[same] < tol, (same, want_margin[same], got, want)


COUNT, COUNT_TOKENS = "Count from one to one thousand:", 60  # the stream a decode rank is killed under


@dataclass(frozen=True)
class FP32:
    """SmolLM2's fp32 weights (loaded once for the module's tests), two chats sharing a long
    system prompt, and the single engine's answers to them; COUNT's greedy completion of
    COUNT_TOKENS by the single engine: what an uninterrupted run streams (the fp32 model
    over 3 ranks answers as over one: test_the_real_model_over_three_ranks_answers_as_over_one)."""

    loaded: object
    chats: list
    want: list[str]
    whole: str


@pytest.fixture(scope="module")
def fp32(smollm):
    from pdserve.engine.model.weights import load_model

    tok = smollm[1]
    loaded = load_model(quantization="none")
    system = "You are a helpful assistant who answers in one short sentence, plainly and kindly. " * 3
    chats = [[{"role": "system", "content": system}, {"role": "user", "content": q}]
             for q in ("Name three colours.", "Name three fruits.")]
    ref = LLMEngine(loaded, EngineConfig(quantization="none", cache=CacheConfig(kv_cache_memory=32 << 20)), tok)
    want = [tok.decode(ref.generate([tok.encode(tok.apply_chat_template(m))], SamplingParams(
        max_tokens=16, temperature=0))[0], skip_special_tokens=True) for m in chats]
    whole = ref.generate([tok.encode(COUNT)], SamplingParams(max_tokens=COUNT_TOKENS, temperature=0, ignore_eos=True))
    return FP32(loaded, chats, want, tok.decode(whole[0], skip_special_tokens=True))


def _degrees(prefill_tp: int, decode_tp: int, decode: int = 1):
    """The cluster of `pdserve up --prefill-tp P --decode-tp D --decode N`: fp32 weights, the
    KV streamed every 5 layers."""
    from pdserve.config import PoolConfig, TransferConfig
    from tests.helpers.clusters import local_config

    engine = EngineConfig(quantization="none", cache=CacheConfig(kv_cache_memory=32 << 20))
    config = local_config(engine=engine, transfer=TransferConfig(layer_group=5))
    return type(config)(**{**config.__dict__, "prefill": PoolConfig(replicas=1, tp=prefill_tp, max_queue=0),
                           "decode": PoolConfig(replicas=decode, tp=decode_tp, max_queue=0)})


def _ask(c, chats):
    """Post the chats one after the other: (responses, the prefill worker's KV pushes, each
    decode worker's (remote prefills, local prefills, transfer failures))."""
    import httpx

    from tests.helpers.clusters import MODEL

    rs = [httpx.post(c.url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": m, "max_tokens": 16, "temperature": 0}) for m in chats]
    pushes = c.worker("prefill-0").worker.stream_pushes
    handoffs = sorted((w.worker.remote_prefills, w.worker.local_prefills, w.worker.transfer_failures)
                      for w in c.workers if w.config.role == "decode")
    return rs, pushes, handoffs


def _assert_answered(rs, pushes, handoffs, want):
    assert [r.status_code for r in rs] == [200, 200], rs[0].text
    assert [r.json()["choices"][0]["message"]["content"] for r in rs] == want
    # both prompts' KV crossed between the groups, to one decode worker (none recomputed)
    assert handoffs == [(0, 0, 0)] * (len(handoffs) - 1) + [(2, 0, 0)]
    assert pushes == 2 * 6  # 30 layers in groups of 5, for each prompt
    cached = rs[1].json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 32  # the shared system prompt's blocks stayed on the decode side: only the tail came


@pytest.mark.slow
def test_served_with_three_prefill_ranks_and_one_decode_rank(smollm, fp32):
    """`pdserve up --prefill-tp 3 --decode-tp 1`: the KV crosses between groups of different
    degrees (gathered to the whole model's layout, split again), streamed every 5 layers as
    they are computed, and for a prompt whose prefix the decode worker holds only the tail
    travels; the answers are the single engine's; every block of every group comes back. (The
    other way round, one prefill rank and three decode ranks, is the first part of the
    decode-rank-killed test below, on its cluster.)"""
    from pdserve.deploy.local import LocalCluster

    chats, want = fp32.chats, fp32.want
    c = LocalCluster(fp32.loaded, smollm[1], _degrees(3, 1)).start()
    try:
        answered = _ask(c, chats)
        engines = c.engines()
        assert [e.tp.tp if e.tp else 1 for e in engines] == [3, 1]
    finally:
        c.stop()
    _assert_answered(*answered, want)
    assert all(e.blocks.num_used_blocks == 0 for e in engines)
    assert all(p.poll() is not None for e in engines if e.tp for p in e.tp.procs)  # the ranks stopped with it


def _stream_killing_a_rank(c, body: dict) -> tuple[list, list, float, float, object]:
    """Stream `body`, and at its fifth event SIGKILL rank 1 of the decode group serving it:
    (events, texts, when killed, when the stream ended, that engine)."""
    import json
    import time

    import httpx

    events, texts, killed_at, victim = [], [], None, None
    with httpx.stream("POST", c.url + "/v1/completions", timeout=120, json=body | {"stream": True}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events.append(json.loads(line[6:]))
            texts += [ch["text"] for ch in events[-1].get("choices", [])]
            if len(events) == 5:
                victim = next(e for e in c.engines() if e.tp and e.has_unfinished_requests())
                os.kill(victim.tp.procs[1].pid, signal.SIGKILL)
                killed_at = time.monotonic()
    assert killed_at is not None
    return events, texts, killed_at, time.monotonic(), victim


@pytest.mark.slow
def test_a_decode_rank_killed_mid_stream_takes_the_group_down_and_the_stream_moves_or_ends(smollm, fp32):
    """`pdserve up --prefill-tp 1 --decode-tp 3 --decode 2` (fp32): first two chats sharing a
    system prompt cross from the prefill rank to one decode group (gathered to the whole
    model's layout, split again), streamed every 5 layers, only the tail of the second, with
    the single engine's answers. Then a rank of the decode group serving a stream is killed: the
    group goes down (every rank gone, every block back). With another decode worker the router
    moves the stream there and it continues with exactly the tokens of an uninterrupted run
    (the single engine's, `fp32.whole`); then, a rank of that last group killed under the next stream, with none left it ends with
    an error event."""
    import httpx

    from pdserve.deploy.local import LocalCluster
    from tests.helpers.clusters import MODEL

    chats, want = fp32.chats, fp32.want
    body = {"model": MODEL, "prompt": COUNT, "max_tokens": COUNT_TOKENS, "temperature": 0, "ignore_eos": True}
    c = LocalCluster(fp32.loaded, smollm[1], _degrees(1, 3, decode=2)).start()
    try:
        answered = _ask(c, chats)
        assert [e.tp.tp if e.tp else 1 for e in c.engines()] == [1, 3, 3]
        moved = _stream_killing_a_rank(c, body)
        metrics = httpx.get(c.url + "/metrics", timeout=10).text
        ended = _stream_killing_a_rank(c, body)
        engines = c.engines()
    finally:
        c.stop()
    _assert_answered(*answered, want)
    events, texts, killed_at, done, first = moved
    assert done - killed_at < 60 and "error" not in events[-1] and "".join(texts) == fp32.whole, (texts, fp32.whole)
    assert "pdserve_migrations_total 1.0" in metrics
    events, texts, killed_at, done, last = ended
    assert last is not first and done - killed_at < 60 and len(texts) < COUNT_TOKENS
    assert "error" in events[-1] or events[-1]["choices"][0].get("finish_reason") == "error", events[-1]
    assert all(e.blocks.num_used_blocks == 0 for e in engines)
    assert all(p.poll() is not None for g in (first, last) for p in g.tp.procs)  # both groups are down
    assert all(p.poll() is not None for e in engines if e.tp for p in e.tp.procs)  # the ranks stopped with it
