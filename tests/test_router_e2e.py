"""End to end through HTTP with the official openai client: a prefill worker, a decode
worker and the router on loopback, the real default model. Disaggregated greedy output
equals the engine's own, token for token; metrics, tokenize and models endpoints. Refused
requests and clients that go away: tests/test_router_e2e_errors.py."""
import concurrent.futures
import re

import httpx
import pytest

from pdserve.deploy.local import LocalCluster
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.core.engine import LLMEngine
from pdserve.engine.kv.cache import engine_kv_format
from pdserve.common.sampling_params import SamplingParams
from tests.helpers.clusters import MODEL, local_config
from tests.helpers.e2e_cluster import client, cluster  # noqa: F401  (module-scoped: this module's own cluster)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(smollm):
    loaded, tok = smollm
    eng = LLMEngine(loaded, EngineConfig(cache=CacheConfig(kv_cache_memory=32 << 20)), tok)

    def run(ids, max_tokens, **params):
        return eng.generate([ids], SamplingParams(max_tokens=max_tokens, temperature=0, **params))[0]
    return run


def chat_ids(tok, content):
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": content}]))


QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "Write a haiku about rain.",
             "What is 12 times 12?"]


def test_chat_greedy_equals_engine(client, smollm, reference):
    tok = smollm[1]
    for q in QUESTIONS[:2]:
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": q}],
                                           max_tokens=40, temperature=0)
        ref = reference(chat_ids(tok, q), 40)
        assert r.choices[0].message.content == tok.decode(ref, skip_special_tokens=True)
        assert r.usage.completion_tokens == len(ref)
        assert r.usage.prompt_tokens == len(chat_ids(tok, q))
        assert r.choices[0].finish_reason == ("stop" if ref[-1] == tok.eos_token_id else "length")


def test_concurrent_requests_each_equal_engine(client, smollm, reference):
    tok = smollm[1]

    def ask(q):
        return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": q}],
                                              max_tokens=24, temperature=0).choices[0].message.content
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(ask, QUESTIONS))
    assert got == [tok.decode(reference(chat_ids(tok, q), 24), skip_special_tokens=True) for q in QUESTIONS]


def test_streaming_equals_non_streaming(client):
    kw = dict(model=MODEL, prompt="The three laws of robotics are", max_tokens=30, temperature=0)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text and text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    chat = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi!"}],
                                               max_tokens=10, temperature=0, stream=True))
    assert chat[0].choices[0].delta.role == "assistant"
    assert chat[-1].choices[0].finish_reason in ("stop", "length")


def test_a_batch_of_prompts_gets_n_choices_each_in_openai_order(client, smollm, reference):
    """Completions take a list of prompts (strings or token lists, as eval harnesses send):
    choice k*n + j is prompt k's j-th; usage counts each prompt once; streamed and collected
    agree (echo: tests/test_api_structured.py)."""
    _, tok = smollm
    texts = ["The capital of France is", "Two plus two equals", "My favourite fruit is the"]
    ids = [tok.encode(t) for t in texts]
    outs = [reference(i, 5) for i in ids]
    want = [tok.decode(o, skip_special_tokens=True) for o in outs]
    r = client.completions.create(model=MODEL, prompt=texts, n=2, max_tokens=5, temperature=0)
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices] == [w for w in want for _ in range(2)]
    assert r.usage.prompt_tokens == sum(map(len, ids)) and r.usage.completion_tokens == 2 * sum(map(len, outs))
    chunks = list(client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    streamed = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == k) for k in range(3)]
    assert streamed == want
    assert chunks[-1].usage.prompt_tokens == sum(map(len, ids))


def test_stop_strings_and_seeded_sampling(client):
    base = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=20, temperature=0).choices[0].text
    assert " 5" in base
    cut = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=20, temperature=0, stop=[" 5"])
    assert cut.choices[0].text == base[:base.index(" 5")] and cut.choices[0].finish_reason == "stop"
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=20, temperature=0.9, seed=42)
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def test_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say yes."}], max_tokens=5,
                                       temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob == pytest.approx(t.logprob)
    c = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0, logprobs=2)
    assert len(c.choices[0].logprobs.tokens) == 4 and len(c.choices[0].logprobs.top_logprobs[0]) == 2


def test_logit_bias_bans_and_forces_tokens_across_the_cluster(client, smollm, reference):
    """The bias travels router -> decode worker -> prefill worker (which samples the first
    token) and applies to every token: banned ones never appear, a forced one always does,
    and the rest is what the engine gives with the same bias."""
    _, tok = smollm
    ids = chat_ids(tok, "Name a colour.")
    plain = reference(ids, 8)
    ban = {str(t): -100 for t in set(plain)}
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name a colour."}],
                                       max_tokens=8, temperature=0, logit_bias=ban)
    want = reference(ids, 8, logit_bias={int(k): v for k, v in ban.items()})
    assert r.choices[0].message.content == tok.decode(want, skip_special_tokens=True)
    assert not set(want) & set(plain)
    forced = tok.encode(" blue")[0]
    c = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0.8, seed=3,
                                  logit_bias={str(forced): 100})
    assert c.choices[0].text == tok.decode([forced] * 5)


def test_min_tokens_keeps_a_short_answer_going_across_the_cluster(cluster, client, smollm, reference):
    """EOS is masked on the prefill worker (first token) and the decode worker alike, and the
    router's stop strings wait too; past min_tokens the answer ends as usual."""
    _, tok = smollm
    decode = cluster.worker("decode-0").worker
    remote, failed = decode.remote_prefills, decode.transfer_failures
    msgs = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]  # "No." and EOS
    plain = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=40, temperature=0)
    assert plain.usage.completion_tokens < 8 and plain.choices[0].finish_reason == "stop"
    held = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=40, temperature=0,
                                          extra_body={"min_tokens": 8})
    want = reference(chat_ids(tok, msgs[0]["content"]), 40, min_tokens=8)
    assert held.usage.completion_tokens == len(want) >= 8
    assert held.choices[0].message.content == tok.decode(want, skip_special_tokens=True)
    stop = plain.choices[0].message.content[:2]  # a stop string at the very start of the answer
    cut = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=40, temperature=0, stop=[stop],
                                         extra_body={"min_tokens": 8})
    assert cut.usage.completion_tokens >= 8
    assert (decode.remote_prefills - remote, decode.transfer_failures - failed) == (3, 0)  # all via the prefill pool


def test_cache_salt_isolates_tenants_across_the_cluster(cluster):
    """Prefill and decode workers and the router's index all hash under the request's salt:
    a repeat within a tenant hits the cache, the same prompt from another tenant (or from no
    tenant) does not, and the answer is the same for all."""
    prompt = "Summarise the rules of chess for a child, in the order a first game needs them. " * 3

    def ask(**salt):
        r = httpx.post(cluster.url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, **salt})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        ask.full_blocks = (usage["prompt_tokens"] - 1) // 16 * 16  # all a hit can cover (the last token is computed)
        return r.json()["choices"][0]["text"], usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)

    text, cached = ask(cache_salt="tenant-a")
    assert cached == 0
    assert ask(cache_salt="tenant-a") == (text, ask.full_blocks)
    assert ask(cache_salt="tenant-b") == (text, 0)
    assert ask() == (text, 0)


def test_health_models_metrics(cluster, client):
    assert httpx.get(cluster.url + "/health").status_code == 200
    assert [m.id for m in client.models.list().data] == [MODEL]
    client.completions.create(model=MODEL, prompt="Metrics test", max_tokens=3, temperature=0)
    text = httpx.get(cluster.url + "/metrics").text
    for name in ("pdserve_time_to_first_token_seconds_count", "pdserve_inter_token_latency_seconds_bucket",
                 "pdserve_time_per_output_token_seconds", "pdserve_e2e_request_latency_seconds",
                 "pdserve_request_queue_seconds", 'pdserve_requests_total{status="length"}',
                 'pdserve_kv_usage_ratio{role="decode",worker="decode-0"}', "pdserve_prefix_cache_hits_tokens"):
        assert name in text, name
    assert "pdserve_time_to_first_token_seconds_count 0.0" not in text


def test_vllm_metric_names_carry_the_same_values(cluster, client):
    """The series under vLLM's names (what existing dashboards, KEDA rules and aiperf read):
    the router's latencies and token counts equal the pdserve_* ones at the same scrape,
    per-worker gauges and prefix-cache counters equal each worker's own stats."""
    from prometheus_client.parser import text_string_to_metric_families
    client.completions.create(model=MODEL, prompt="Metric names", max_tokens=4, temperature=0)
    cluster.run(cluster.router.cluster.refresh())
    stats = dict(cluster.router.cluster.stats)
    samples = {}
    for fam in text_string_to_metric_families(httpx.get(cluster.url + "/metrics").text):
        for smp in fam.samples:
            samples[(smp.name, tuple(sorted(smp.labels.items())))] = smp.value
    model = (("model_name", MODEL),)
    for vllm, ours in (("vllm:time_to_first_token_seconds_count", "pdserve_time_to_first_token_seconds_count"),
                       ("vllm:inter_token_latency_seconds_count", "pdserve_inter_token_latency_seconds_count"),
                       ("vllm:e2e_request_latency_seconds_sum", "pdserve_e2e_request_latency_seconds_sum"),
                       ("vllm:prompt_tokens_total", "pdserve_prompt_tokens_total"),
                       ("vllm:generation_tokens_total", "pdserve_generation_tokens_total")):
        assert samples[(vllm, model)] == samples[(ours, ())] > 0, vllm
    for wid, s in stats.items():
        labels = tuple(sorted({"model_name": MODEL, "engine": wid, "role": s.role}.items()))
        assert samples[("vllm:num_requests_running", labels)] == s.running
        assert samples[("vllm:num_requests_waiting", labels)] == s.waiting
        assert samples[("vllm:kv_cache_usage_perc", labels)] == pytest.approx(s.kv_usage)
        assert samples[("vllm:prefix_cache_queries_total", labels)] == s.prefix_queries
        assert samples[("vllm:prefix_cache_hits_total", labels)] == s.prefix_hits
    assert stats["prefill-0"].prefix_queries > 0


def test_tokenize_counts_what_a_request_is_billed_and_detokenize_inverts_it(cluster, client, smollm):
    tok = smollm[1]
    post = lambda path, **body: httpx.post(cluster.url + path, timeout=30, json={"model": MODEL, **body})  # noqa: E731
    r = post("/tokenize", prompt="Hello, world!").json()
    assert r == {"count": len(tok.encode("Hello, world!")), "tokens": tok.encode("Hello, world!")}
    assert post("/detokenize", tokens=r["tokens"]).json() == {"prompt": "Hello, world!"}
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"}]
    for extra in ({}, {"tools": tools}):
        counted = post("/tokenize", messages=msgs, **extra).json()["count"]
        billed = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1, temperature=0,
                                                parallel_tool_calls=False, **extra).usage.prompt_tokens
        assert counted == billed
    for path, body, param in (("/tokenize", {"prompt": "a", "messages": msgs}, "prompt"), ("/tokenize", {}, "prompt"),
                              ("/detokenize", {"tokens": [10**9]}, "tokens"), ("/detokenize", {"tokens": "x"}, "tokens")):
        bad = post(path, **body)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
    assert post("/tokenize", messages=[]).json()["error"]["param"] == "messages"  # as chat refuses it
    assert httpx.post(cluster.url + "/tokenize", json={"prompt": "x"}).json()["count"] == 1  # model optional
    assert httpx.post(cluster.url + "/tokenize", json={"model": "gpt-4", "prompt": "x"}).status_code == 404


def test_a_model_is_retrieved_by_its_id(cluster, client):
    assert client.models.retrieve(MODEL).id == MODEL
    r = httpx.get(cluster.url + "/v1/models/gpt-4")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_disaggregation_really_happened(cluster, smollm):
    cluster.run(cluster.router.cluster.refresh())
    s = cluster.router.cluster.stats
    assert s["decode-0"].remote_prefills > 0 and s["prefill-0"].remote_prefills == s["decode-0"].remote_prefills
    assert s["decode-0"].local_prefills == 0
    # transfer volume and time are exported: bytes pushed == bytes received, time > 0
    assert s["prefill-0"].kv_bytes == s["decode-0"].kv_bytes > 0 and s["prefill-0"].kv_seconds > 0
    text = httpx.get(cluster.url + "/metrics").text
    assert 'pdserve_kv_transfer_bytes_total{role="prefill",worker="prefill-0"}' in text
    assert 'pdserve_kv_transfer_failures_total{role="decode",worker="decode-0"} 0.0' in text
    # every remote prefill's bytes in the per-request histogram (requests reach the workers
    # only through this router): as many as the hand-offs, summing to what decode received
    count = float(re.search(r"^pdserve_kv_transfer_request_bytes_count (\S+)$", text, re.M).group(1))
    total = float(re.search(r"^pdserve_kv_transfer_request_bytes_sum (\S+)$", text, re.M).group(1))
    assert count == s["decode-0"].remote_prefills and total == s["decode-0"].kv_bytes
    # and where each one's time to first token went: one observation per hand-off in each part
    for part in ("blocks_wait", "prefill_queue", "prefill_compute", "kv_push"):
        n = float(re.search(rf"^pdserve_{part}_seconds_count (\S+)$", text, re.M).group(1))
        assert n == s["decode-0"].remote_prefills, part
    compute = float(re.search(r"^pdserve_prefill_compute_seconds_sum (\S+)$", text, re.M).group(1))
    ttft = float(re.search(r"^pdserve_time_to_first_token_seconds_sum (\S+)$", text, re.M).group(1))
    assert 0 < compute < ttft
    fmt = engine_kv_format(EngineConfig(), smollm[0].model).name  # bfloat16 under the default numerics
    assert f'pdserve_kv_cache_info{{kv_cache_dtype="{fmt}",role="decode",worker="decode-0"}} 1.0' in text


def test_aggregated_mode_equals_engine(smollm, reference):
    loaded, tok = smollm
    cfg = local_config(32 << 20, mode="aggregated")
    c = LocalCluster(loaded, tok, cfg).start()
    try:
        r = httpx.post(c.url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": [{"role": "user", "content": QUESTIONS[0]}], "max_tokens": 24, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == tok.decode(reference(chat_ids(tok, QUESTIONS[0]), 24),
                                                                          skip_special_tokens=True)
        c.run(c.router.cluster.refresh())
        s = c.router.cluster.stats["aggregated-0"]
        assert s.local_prefills == 1 and s.remote_prefills == 0
    finally:
        c.stop()
    assert all(e.blocks.num_used_blocks == 0 for e in c.engines())
