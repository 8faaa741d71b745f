"""One client cannot hurt the others, through the in-process cluster and the OpenAI API:
a grammar past its mask-time budget ends with a clear error while another stream goes on; a
prompt far past the context is refused before it is tokenized, and tokenizing runs off the
event loop; prompt logprobs are computed once per prompt for every choice; priorities,
tenants and sessions from the body and the headers."""
from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import pytest

from pdserve.common.errors import InvalidRequestError
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.structured import Structured
from pdserve.deploy.local import LocalCluster
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.core.engine import LLMEngine
from tests.helpers.clusters import MODEL, local_config

pytestmark = pytest.mark.slow
AMBIGUOUS = 'start: s\ns: s s | s s s | "a" | "b" | " "\n'  # Earley items grow with every token


def metric(text: str, name: str, **labels) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = rf"^{re.escape(name)}(?:\{{[^}}]*{re.escape(want)}[^}}]*\}})? (\S+)$" if want else \
        rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$"
    return sum(float(m) for m in re.findall(pattern, text, re.M))


def test_a_grammar_past_its_budget_ends_with_an_error_and_the_batch_goes_on(smollm):
    loaded, tok = smollm
    # unbounded, this grammar's masks take 0.33 s until it stops at its 16th token on a 2-core
    # Zen 4: a budget of 0.1 s ends it first on any CPU
    eng = LLMEngine(loaded, EngineConfig(cache=CacheConfig(kv_cache_memory=32 << 20), grammar_budget_s=0.1,
                                         grammar_step_budget_ms=0), tok)
    eng.add_request("grammar", tok.encode("Write a and b:"), SamplingParams(
        max_tokens=200, temperature=0, structured=Structured("grammar", AMBIGUOUS)))
    eng.add_request("plain", tok.encode("Count to ten:"), SamplingParams(max_tokens=40, temperature=0,
                                                                          ignore_eos=True))
    state = eng.scheduler.requests["grammar"].grammar
    outs: dict[str, list] = {"grammar": [], "plain": []}
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id].append(o)
    last = outs["grammar"][-1]
    assert last.finish_reason == "error" and "budget" in last.error and len(outs["grammar"]) < 200
    # bounded by construction: it ended at the first token whose masks passed the budget
    assert state.mask_s - state.last_mask_s <= 0.1 < state.mask_s
    assert outs["plain"][-1].finish_reason == "length" and sum(len(o.new_token_ids) for o in outs["plain"]) == 40
    assert eng.blocks.num_used_blocks == 0
    eng.shutdown()


@pytest.fixture(scope="module")
def cluster(smollm):
    loaded, tok = smollm
    c = LocalCluster(loaded, tok, local_config(
        64 << 20, decode=2, engine=EngineConfig(cache=CacheConfig(kv_cache_memory=64 << 20), grammar_budget_s=0.3),
        router={"tenant_max_inflight": 4})).start()
    yield c
    c.stop()
    assert all(e.blocks.num_used_blocks == 0 and not e.has_unfinished_requests() for e in c.engines())


def test_the_api_names_the_grammar_budget_and_other_streams_finish(cluster):
    async def main():
        async with httpx.AsyncClient(base_url=cluster.url, timeout=120) as http:
            bad = http.post("/v1/completions", json={
                "model": MODEL, "prompt": "a b", "max_tokens": 150, "temperature": 0,
                "response_format": {"type": "grammar", "grammar": AMBIGUOUS}})
            good = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 30,
                                                      "temperature": 0, "ignore_eos": True})
            return await asyncio.gather(bad, good)
    bad, good = asyncio.run(main())
    assert bad.status_code == 400, bad.text
    err = bad.json()["error"]
    assert err["param"] == "response_format" and err["code"] == "grammar_budget_exceeded" and "budget" in err["message"]
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 30


def test_a_prompt_past_any_context_is_refused_before_tokenizing_and_tokenizing_leaves_the_loop(cluster):
    tok = cluster.router.tokenizer
    limit = cluster.router.cluster.max_model_len()
    huge = "x" * (2 * tok.max_token_chars * limit + 1)
    r = httpx.post(cluster.url + "/v1/completions", json={"model": MODEL, "prompt": huge, "max_tokens": 1},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    m = httpx.get(cluster.url + "/metrics").text
    assert metric(m, "pdserve_budget_refusals_total", budget="prompt_chars") >= 1
    # just under the bound: it is tokenized (then refused by its token count), and /health
    # answers while that runs
    words = [f"w{i} " for i in range(2 * tok.max_token_chars * limit)]
    long = "".join(words)[:2 * tok.max_token_chars * limit - 100]

    async def main():
        async with httpx.AsyncClient(base_url=cluster.url, timeout=120) as http:
            big = asyncio.ensure_future(http.post("/v1/completions", json={"model": MODEL, "prompt": long,
                                                                            "max_tokens": 1}))
            answered_meanwhile = 0
            while not big.done():
                health = await http.get("/health")
                answered_meanwhile += health.status_code == 200 and not big.done()
                await asyncio.sleep(0.01)
            return answered_meanwhile, await big
    answered_meanwhile, big = asyncio.run(main())
    assert answered_meanwhile >= 3
    assert big.status_code == 400 and big.json()["error"]["code"] == "context_length_exceeded"


def test_prompt_logprobs_are_computed_once_on_the_prefill_pool(cluster, smollm):
    decode = [w.worker for w in cluster.workers if w.config.role == "decode"]
    before = [sum(w.local_prefills for w in decode), sum(w.remote_prefills for w in decode)]
    prompt = "The quick brown fox jumps over the lazy dog. " * 12
    r = httpx.post(cluster.url + "/v1/completions", json={
        "model": MODEL, "prompt": prompt, "max_tokens": 3, "n": 4, "echo": True, "logprobs": 1,
        "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    n_prompt = r.json()["usage"]["prompt_tokens"]
    firsts = [c["logprobs"]["token_logprobs"][:n_prompt] for c in choices]
    assert all(f == firsts[0] for f in firsts) and firsts[0][0] is None and len(firsts[0]) == n_prompt
    # only the first choice asked for them, and every prompt went through the prefill pool:
    # the logprobs came back with the KV, nothing recomputed the prompt beside the decode batch
    after = [sum(w.local_prefills for w in decode), sum(w.remote_prefills for w in decode)]
    assert [a - b for a, b in zip(after, before)] == [0, 4]
    loaded, tok = smollm  # the same numbers as one engine computing the prompt itself
    eng = LLMEngine(loaded, EngineConfig(cache=CacheConfig(kv_cache_memory=16 << 20)), tok)
    eng.add_request("ref", tok.encode(prompt), SamplingParams(max_tokens=1, prompt_logprobs=1))
    want = []
    while eng.has_unfinished_requests():
        want += [lp.logprob for o in eng.step() for lp in (o.prompt_logprobs or [])]
    assert firsts[0][1:] == pytest.approx(want, abs=1e-5)


def test_priority_tenant_and_session_from_body_and_headers(cluster):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "temperature": 0}
    r = httpx.post(cluster.url + "/v1/completions", json=body | {"priority": -3},
                   headers={"x-pdserve-tenant": "alice"}, timeout=60)
    assert r.status_code == 200
    r = httpx.post(cluster.url + "/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "priority": 4},
        timeout=60)
    assert r.status_code == 200
    bad = httpx.post(cluster.url + "/v1/completions", json=body, headers={"x-pdserve-priority": "soon"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-pdserve-priority"
    bad = httpx.post(cluster.url + "/v1/completions", json=body | {"priority": "high"})
    assert bad.status_code == 400
    m = httpx.get(cluster.url + "/metrics").text
    assert metric(m, "pdserve_class_wait_seconds_count", priority="high", tenant="alice") == 1
    assert metric(m, "pdserve_class_wait_seconds_count", priority="low", tenant="default") >= 1
    # a session stays on its decode worker while that worker has room
    bound = cluster.router.cluster.affinity
    for _ in range(4):
        assert httpx.post(cluster.url + "/v1/completions", json=body, headers={"x-pdserve-session": "s1"},
                          timeout=60).status_code == 200
    assert bound.kept >= 3 and "s1" in bound.bound
    for user_turn in range(3):  # `user` names the session when no header does
        assert httpx.post(cluster.url + "/v1/completions", json=body | {"user": "u9"}, timeout=60).status_code == 200
    assert "u9" in bound.bound


def test_a_tenant_past_its_limit_is_refused_alone(cluster):
    body = {"model": MODEL, "prompt": "Tell me a story.", "max_tokens": 60, "temperature": 0, "ignore_eos": True}

    async def main():
        async with httpx.AsyncClient(base_url=cluster.url, timeout=120) as http:
            mine = [asyncio.ensure_future(http.post("/v1/completions", json=body, headers={"x-pdserve-tenant": "t1"}))
                    for _ in range(4)]
            await asyncio.sleep(0.3)
            third = await http.post("/v1/completions", json=body | {"max_tokens": 2},
                                    headers={"x-pdserve-tenant": "t1"})
            other = await http.post("/v1/completions", json=body | {"max_tokens": 2},
                                    headers={"x-pdserve-tenant": "t2"})
            return third, other, await asyncio.gather(*mine)
    third, other, mine = asyncio.run(main())
    assert third.status_code == 429 and third.json()["error"]["code"] == "tenant_inflight_limit"
    assert other.status_code == 200 and all(r.status_code == 200 for r in mine)


def test_fair_by_default_the_tenant_with_fewer_requests_in_flight_goes_first():
    from pdserve.router.tenancy import TenantLimits

    t = TenantLimits()
    for _ in range(3):
        t.admit("A", 100)
    assert t.fair_priority("A") == 0  # alone: nobody to be fair to
    t.admit("B", 10)
    assert t.fair_priority("B") == -1 and t.fair_priority("A") == 0
    assert t.fair_priority("") == 0  # no tenant: first come, first served
    for _ in range(2):
        t.done("A")
    assert t.fair_priority("B") == 0  # one each: equal


def test_the_step_budget_keeps_less_urgent_decodes_out_of_an_urgent_step_they_would_slow():
    """The cost model learns seconds = a + b * tokens + c * context from small steps; beside one
    urgent decode (budget 0.3) a row costing as much as the urgent one does not fit, beside ten
    urgent rows three do, and a row that reads a long context costs what its attention reads;
    before any step has run, there is no allowance (`yield_decodes` holds)."""
    from pdserve.engine.core.step_cost import StepCost, StepTimes

    cost = StepCost()
    assert cost.allowance(1, 100, 0.3) is None and cost.row_seconds(1000) == 0.0
    for n in (1, 2, 4, 8, 16, 32):
        cost.observe(0.001 + 0.002 * n, n, 50 * n)  # context in proportion: the slopes are one
    a, b, c = cost.fit()
    assert abs(a - 0.001) < 1e-6 and abs(b - 0.002) < 1e-6 and c == 0.0
    row = cost.row_seconds(50)
    assert cost.allowance(1, 50, 0.3) < row and 3 * row <= cost.allowance(10, 500, 0.3) < 4 * row
    cost = StepCost()
    for n, ctx in ((1, 100), (2, 200), (2, 1100), (4, 400), (4, 4000), (8, 800), (16, 16000), (32, 3200)):
        cost.observe(0.002 + 0.0001 * n + 4e-6 * ctx, n, ctx)  # 4 ms a thousand keys
    a, b, c = cost.fit()
    assert abs(a - 0.002) < 1e-6 and abs(b - 0.0001) < 1e-7 and abs(c - 4e-6) < 1e-9
    beside_one = cost.allowance(1, 80, 0.3)  # one short urgent decode: ~0.7 ms of room
    assert cost.row_seconds(80) <= beside_one < cost.row_seconds(1000)  # a short row fits, a long one not
    assert abs(cost.chunk_seconds(16, 984) - (16 * 0.0001 + 1000 * 4e-6)) < 1e-9  # 16 tokens to key 1,000
    n = cost.chunk_tokens(0.006, 984)  # what fits in 6 ms from there: (6 - 3.936) / 0.104 ms
    assert n == 19 and cost.chunk_seconds(n, 984) <= 0.006 < cost.chunk_seconds(n + 1, 984)
    assert cost.chunk_tokens(0.003, 984) == 0 and StepCost().chunk_tokens(0.001, 5000) > 10 ** 6
    times = StepTimes()
    times.add(0.003, contended=True)
    times.add(0.5, contended=False)
    times.add(0.01, contended=False, window=True)
    counts, total = times.snapshot()["contended"]
    assert counts[4] == 1 and counts[3] == 0 and counts[-1] == 1 and total == 0.003  # 2.83 ms < 3 ms <= 4 ms
    assert times.snapshot()["plain"][0][-2] == 1 and times.snapshot()["window"][0][7] == 1  # 8 ms < 10 ms <= 11.3


def _joint():
    """The same steps as below, fitted together only."""
    from pdserve.engine.core.step_cost import StepCost
    joint = StepCost()
    for n in (8, 16, 32, 48, 64):
        joint.observe(0.009 + 0.0003 * n, n, n * n // 2)
    for n in (1, 2, 4, 8):
        joint.observe(0.0068 + 0.0022 * n, n, 60 * n)
    joint.observe(0.0068 + 0.0012 * 24, 24, 60 * 24)
    return joint


def test_a_decode_rows_cost_is_learned_from_decode_steps_not_from_prompt_chunks():
    """A short prompt chunk's tokens share its matmuls, a decode row pays for its own, and a
    whole batch's rows amortize the step's fixed work: fitted over all, a row looks cheaper
    than it is beside one urgent decode (the Xeon: a second row made a 12 ms step 15 ms, and
    the joint fit let it into a step of 15% budget). The rows' cost and the budget beside
    urgent decodes come from small decode-only steps; a chunk's from all."""
    from pdserve.engine.core.step_cost import StepCost

    cost = StepCost()
    for n in (8, 16, 32, 48, 64):  # prompt chunks: 0.3 ms a token
        cost.observe(0.009 + 0.0003 * n, n, n * n // 2)
    for n in (1, 2, 4, 8):  # decode rows of 60 keys each: 2.2 ms a row
        cost.observe(0.0068 + 0.0022 * n, n, 60 * n, rows=True)
    cost.observe(0.0068 + 0.0012 * 24, 24, 60 * 24, rows=True)  # a whole batch's rows amortize more
    assert abs(cost.row_seconds(60, small=True) - 0.0022) < 1e-4  # the small decode steps' slope
    assert cost.allowance(1, 60, 0.15) < cost.row_seconds(60, small=True)  # no less urgent row joins one urgent decode
    joint = _joint()
    assert cost.row_seconds(60) == joint.row_seconds(60)  # window steps are sized as before
    assert joint.row_seconds(60) < joint.allowance(1, 60, 0.15)  # the joint fit let it in
    low = _joint()  # a few noisy small steps that fit a low slope never price a row below the joint fit
    for t, n in ((0.0130, 1), (0.0120, 1), (0.0126, 2)):
        low.observe(t, n, 60 * n, rows=True)
    assert low.row_seconds(60, small=True) == low.row_seconds(60) > low._rows.row_seconds(60)
    assert cost.chunk_seconds(32, 0) == joint.chunk_seconds(32, 0)  # chunks are priced as before


def test_a_kv_hand_off_refused_for_blocks_compiles_no_grammar_and_a_bad_one_gives_its_blocks_back(smollm,
                                                                                                   monkeypatch):
    """Under KV pressure a decode worker retries a refused hand-off every 50 ms per request: on a
    2-core Zen 4, 24 such retries of JSON-schema requests took 12 ms of every 50 on the engine
    thread, beside an urgent stream. The grammar is compiled once the blocks are taken; if it
    fails then, the blocks and the seat go back and the caller gets the error."""
    loaded, tok = smollm
    eng = LLMEngine(loaded, EngineConfig(cache=CacheConfig(kv_cache_memory=8 << 20)), tok)
    compiled = []
    real = eng._grammar
    monkeypatch.setattr(eng, "_grammar", lambda params: (params.structured and compiled.append(params.structured))
                        or real(params))
    schema = Structured("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}}))
    long = list(range(100, 100 + (eng.blocks.num_blocks - 2) * eng.blocks.block_size))  # all but 2 blocks
    assert eng.add_remote_request("hog", long, SamplingParams(max_tokens=1)) is not None
    for k in range(20):
        assert eng.add_remote_request(f"r{k}", list(range(5, 60)), SamplingParams(max_tokens=8, structured=schema)) is None
    assert compiled == [] and set(eng.scheduler.requests) == {"hog"}
    eng.abort("hog")
    assert eng.add_remote_request("ok", list(range(5, 60)), SamplingParams(max_tokens=8, structured=schema))
    assert compiled == [schema] and eng.scheduler.requests["ok"].grammar is not None
    eng.abort("ok")
    free = eng.blocks.num_free_blocks
    bad = Structured("regex", "(unclosed")
    with pytest.raises(InvalidRequestError):
        eng.add_remote_request("bad", list(range(5, 60)), SamplingParams(max_tokens=8, structured=bad))
    assert "bad" not in eng.scheduler.requests and eng.blocks.num_free_blocks == free
    eng.blocks.check_invariants()
