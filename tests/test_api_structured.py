"""Structured output, n > 1, echo and tool calls through the disaggregated cluster and the
OpenAI client: the grammar state survives the prefill -> decode hand-off and a migration
between decode workers; every KV block comes back."""
import json
import re

import httpx
import jsonschema
import pytest

from pdserve.deploy.local import LocalCluster
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.core.engine import LLMEngine
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.structured import Structured
from tests.helpers.clusters import local_config
from tests.helpers.streams import stream_and_kill

pytestmark = pytest.mark.slow
MODEL = "smollm2"
SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20},
    "population": {"type": "integer", "minimum": 0, "maximum": 50000000},
    "tags": {"type": "array", "items": {"enum": ["old", "big", "coastal"]}, "maxItems": 3}},
    "required": ["city", "population", "tags"], "additionalProperties": False}
RF = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 20},
                                                "unit": {"enum": ["celsius", "fahrenheit"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def cluster(smollm):
    loaded, tok = smollm
    c = LocalCluster(loaded, tok, local_config(64 << 20, decode=2)).start()
    yield c
    c.stop()
    assert all(e.blocks.num_used_blocks == 0 and not e.has_unfinished_requests() for e in c.engines())


@pytest.fixture(scope="module")
def reference(smollm):
    loaded, tok = smollm
    eng = LLMEngine(loaded, EngineConfig(cache=CacheConfig(kv_cache_memory=64 << 20)), tok)
    return lambda ids, params: tok.decode(eng.generate([ids], params)[0], skip_special_tokens=True)


def chat_ids(tok, text):
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


def client(c):
    from openai import OpenAI
    return OpenAI(base_url=c.url + "/v1", api_key="unused", max_retries=0)


def test_json_schema_survives_the_hand_off(cluster, smollm, reference):
    tok = smollm[1]
    msgs = [{"role": "user", "content": "Describe Lisbon as JSON."}]
    before = cluster.worker("decode-0").worker.remote_prefills + cluster.worker("decode-1").worker.remote_prefills
    r = client(cluster).chat.completions.create(model=MODEL, messages=msgs, max_tokens=120, temperature=0,
                                                response_format=RF)
    text = r.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    params = SamplingParams(max_tokens=120, temperature=0, structured=Structured("json_schema", json.dumps(SCHEMA)))
    assert text == reference(chat_ids(tok, msgs[0]["content"]), params)  # masked on prefill and on decode
    after = cluster.worker("decode-0").worker.remote_prefills + cluster.worker("decode-1").worker.remote_prefills
    assert after == before + 1 and r.choices[0].finish_reason == "stop"
    stream = client(cluster).chat.completions.create(model=MODEL, messages=msgs, max_tokens=120, temperature=0,
                                                     response_format=RF, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text


def test_regex_choice_and_concurrent_unconstrained(cluster, smollm, reference):
    import concurrent.futures as cf
    tok = smollm[1]
    free = {"model": MODEL, "prompt": "The sea is", "max_tokens": 16, "temperature": 0}
    bodies = [free, {"model": MODEL, "prompt": "Is water wet? Answer:", "max_tokens": 8, "temperature": 0,
                     "response_format": {"type": "choice", "choices": [" yes", " no"]}},
              {"model": MODEL, "prompt": "Call me at", "max_tokens": 16, "temperature": 0.9, "seed": 2,
               "response_format": {"type": "regex", "regex": " [0-9]{3}-[0-9]{4}"}}]
    with cf.ThreadPoolExecutor(3) as pool:
        rs = list(pool.map(lambda b: httpx.post(cluster.url + "/v1/completions", json=b, timeout=60), bodies))
    texts = [r.json()["choices"][0]["text"] for r in rs]
    assert texts[0] == reference(tok.encode("The sea is"), SamplingParams(max_tokens=16, temperature=0))
    assert texts[1] in (" yes", " no")
    assert re.fullmatch(r" [0-9]{3}-[0-9]{4}", texts[2])


def test_n_choices_share_the_prompt_and_differ(cluster, smollm, reference):
    tok = smollm[1]
    prompt = "Once upon a time in a small village " * 4  # several full blocks to share
    r = httpx.post(cluster.url + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": prompt, "max_tokens": 10, "temperature": 0.9, "seed": 11, "n": 3})
    body = r.json()
    texts = [c["text"] for c in sorted(body["choices"], key=lambda c: c["index"])]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2] and len(set(texts)) == 3
    for i, text in enumerate(texts):  # choice i is seed + i: reproducible
        assert text == reference(tok.encode(prompt), SamplingParams(max_tokens=10, temperature=0.9, seed=11 + i))
    assert body["usage"]["completion_tokens"] == 30 and body["usage"]["prompt_tokens"] == len(tok.encode(prompt))
    stream = httpx.post(cluster.url + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0.9, "seed": 11, "n": 2, "stream": True})
    events = [json.loads(line[6:]) for line in stream.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    streamed = ["".join(e["choices"][0]["text"] for e in events if e["choices"][0]["index"] == i) for i in (0, 1)]
    assert all(sum(1 for e in events if e["choices"][0]["index"] == i and e["choices"][0]["finish_reason"]) == 1
               for i in (0, 1))
    assert streamed == [reference(tok.encode(prompt), SamplingParams(max_tokens=6, temperature=0.9, seed=11 + i))
                        for i in (0, 1)]


def test_echo(cluster):
    r = httpx.post(cluster.url + "/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": "Hello there", "max_tokens": 4, "temperature": 0, "echo": True})
    assert r.json()["choices"][0]["text"].startswith("Hello there")


def test_echo_with_prompt_logprobs(cluster, smollm):
    tok = smollm[1]
    prompt = "The capital of France is"
    ids = tok.encode(prompt)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 2}
    r = httpx.post(cluster.url + "/v1/completions", timeout=60, json=body).json()["choices"][0]
    lp = r["logprobs"]
    assert r["text"].startswith(prompt) and len(lp["tokens"]) == len(ids) + 3
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(v, float) and v <= 0 for v in lp["token_logprobs"][1:])
    assert all(len(t) == 2 for t in lp["top_logprobs"][1:]) and lp["text_offset"][0] == 0
    events = [json.loads(line[6:]) for line in httpx.post(cluster.url + "/v1/completions", timeout=60,
                                                         json=body | {"stream": True}).text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    streamed = [v for e in events if e["choices"][0]["logprobs"] for v in e["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed == lp["token_logprobs"]


def test_echo_of_a_batch_gives_each_choice_its_own_prompt(cluster, smollm):
    tok = smollm[1]
    texts = ["The capital of France is", "Two plus two equals"]
    ids = [tok.encode(t) for t in texts]
    body = {"model": MODEL, "prompt": ids, "n": 2, "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 1}
    choices = httpx.post(cluster.url + "/v1/completions", timeout=60, json=body).json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    for c, i, t in zip(choices, [ids[0], ids[0], ids[1], ids[1]], [texts[0], texts[0], texts[1], texts[1]]):
        lp = c["logprobs"]
        assert c["text"].startswith(t) and len(lp["tokens"]) == len(i) + 2 and lp["token_logprobs"][0] is None
    events = [json.loads(line[6:]) for line in httpx.post(cluster.url + "/v1/completions", timeout=60,
                                                         json=body | {"stream": True}).text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    streamed = ["".join(e["choices"][0]["text"] for e in events if e["choices"][0]["index"] == k) for k in range(4)]
    assert streamed == [c["text"] for c in choices]


def test_forced_tool_call(cluster):
    msgs = [{"role": "user", "content": "What's the weather in Oslo?"}]
    r = client(cluster).chat.completions.create(
        model=MODEL, messages=msgs, tools=[WEATHER], max_tokens=80, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    # the result goes back as a tool message; the model answers in text
    follow = msgs + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 3}'}]
    r2 = client(cluster).chat.completions.create(model=MODEL, messages=follow, tools=[WEATHER], tool_choice="none",
                                                 max_tokens=16, temperature=0)
    assert r2.choices[0].message.content and r2.choices[0].finish_reason in ("stop", "length")
    stream = client(cluster).chat.completions.create(
        model=MODEL, messages=msgs, tools=[WEATHER], max_tokens=80, temperature=0, tool_choice="required", stream=True)
    chunks = [c for c in stream if c.choices]
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.name == "get_weather" and chunks[-1].choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER["function"]["parameters"])


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    # legal-looking JSON of the wrong shape: a 400 naming it, not a 500
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": "get_weather"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": None}}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [1, "x"]}]}, "messages"),
    ({"messages": [{"role": "assistant", "tool_calls": "get_weather"}]}, "messages"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}]}, "messages"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
])
def test_bad_tool_and_format_combinations_are_400(cluster, body, param):
    r = httpx.post(cluster.url + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4} | body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    if "messages" in body:  # /tokenize renders messages the same way, and refuses them the same way
        r = httpx.post(cluster.url + "/tokenize", timeout=30, json={"model": MODEL} | body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_json_schema_survives_a_migration(cluster, smollm, reference):
    tok = smollm[1]
    prompt = "A JSON record about Rome:"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 120, "temperature": 0.7, "seed": 5, "response_format": RF}
    text, events = stream_and_kill(cluster, body, kill_after=6)  # last test: one decode worker is gone after it
    jsonschema.validate(json.loads(text), SCHEMA)
    params = SamplingParams(max_tokens=120, temperature=0.7, seed=5, structured=Structured("json_schema", json.dumps(SCHEMA)))
    assert text == reference(tok.encode(prompt), params) and events[-1]["choices"][0]["finish_reason"] == "stop"
    assert "pdserve_migrations_total 1.0" in httpx.get(cluster.url + "/metrics").text
