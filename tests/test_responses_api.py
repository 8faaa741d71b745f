"""The Responses API (`/v1/responses`) through the official `openai` SDK, against an
in-process cluster serving the real default model: one prefill and two decode workers that
the router alternates between (round robin, so a conversation staying on one is the session
affinity's doing; a prompt they hold all but 64 tokens of, they prefill themselves), its registry and stored responses in a real Redis, and two API keys (two
tenants)."""
import json

import httpx
import openai
import pytest
import redis
from pydantic import BaseModel, Field

from pdserve.config import RegistryConfig
from pdserve.deploy.local import LocalCluster
from pdserve.protos.security import SecurityConfig
from pdserve.registry.embedded import EmbeddedRedis
from tests.helpers.clusters import local_config

MODEL = "smollm2"
KEYS = ("key-ada", "key-bob")
TIMING = {"X-PDServe-Timing": "1"}  # pdserve's extension: where the response ran
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city now.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def redis_server():
    with EmbeddedRedis() as r:
        yield r


@pytest.fixture(scope="module")
def cluster(smollm, redis_server):
    loaded, tok = smollm
    cfg = local_config(64 << 20, decode=2, router={"routing": "round_robin", "decode_local_prefill": 64},
                       registry=RegistryConfig(redis_url=redis_server.url, cluster_name="resp"),
                       security=SecurityConfig(api_keys=KEYS))
    c = LocalCluster(loaded, tok, cfg).start()
    yield c
    c.stop()
    for eng in c.engines():
        assert eng.blocks.num_used_blocks == 0 and not eng.has_unfinished_requests()


@pytest.fixture(scope="module")
def ada(cluster):
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key=KEYS[0], max_retries=0)


@pytest.fixture(scope="module")
def bob(cluster):
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key=KEYS[1], max_retries=0)


def test_plain_response_is_stored_in_redis_then_deleted(ada, redis_server):
    r = ada.responses.create(model=MODEL, input="Name a planet.", instructions="Answer in one word.",
                             max_output_tokens=8, temperature=0)
    assert r.id.startswith("resp_") and r.object == "response" and r.status in ("completed", "incomplete")
    assert r.output[0].type == "message" and r.output_text.strip()
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 8
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert ada.responses.retrieve(r.id).output_text == r.output_text
    db = redis.Redis.from_url(redis_server.url)
    assert [k for k in db.keys("pdserve:resp:response:*") if k.decode().endswith(r.id)]
    ada.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        ada.responses.retrieve(r.id)
    off = ada.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        ada.responses.retrieve(off.id)


def test_streamed_events_come_in_order_and_add_up(ada):
    events = list(ada.responses.create(model=MODEL, input="Count from one to five.", max_output_tokens=12,
                                       temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text and final.output_text == text == events[-4].text
    assert final.usage.output_tokens <= 12 and ada.responses.retrieve(final.id).output_text == text


def test_function_call_round_trip(ada):
    ask = {"role": "user", "content": "What is the weather in Paris?"}
    r = ada.responses.create(model=MODEL, input=[ask], tools=[WEATHER], tool_choice="required", max_output_tokens=40)
    call = r.output[0]
    assert call.type == "function_call" and call.name == "get_weather" and r.status == "completed"
    assert isinstance(json.loads(call.arguments)["city"], str) and call.call_id
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "22 C and sunny"}
    # stateless: the call sent back as an input item, as the SDK's output objects
    again = ada.responses.create(model=MODEL, input=[ask, *r.output, result], tools=[WEATHER], max_output_tokens=16)
    assert again.output_text.strip()
    # stateful: only the result, after the stored call
    follow = ada.responses.create(model=MODEL, previous_response_id=r.id, input=[result], max_output_tokens=16)
    assert follow.output_text.strip() and follow.previous_response_id == r.id


def test_function_call_streams_its_arguments(ada):
    # the SDK's stream helper: it rebuilds the response from the events and checks their ids
    with ada.responses.stream(model=MODEL, input="Weather in Rome?", tools=[WEATHER], max_output_tokens=40,
                              tool_choice={"type": "function", "name": "get_weather"}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert json.loads(done.arguments)["city"] and final.output[0].arguments == done.arguments


class City(BaseModel):
    name: str = Field(max_length=20)
    population: int


def test_structured_output_parses(ada):
    r = ada.responses.parse(model=MODEL, input="Describe Lisbon.", text_format=City, max_output_tokens=60)
    assert isinstance(r.output_parsed, City)  # the grammar made it valid; its facts are the small model's
    assert City.model_validate_json(ada.responses.retrieve(r.id).output_text) == r.output_parsed


def test_a_conversation_stays_on_its_worker_and_reuses_its_cache(ada):
    ask = {"model": MODEL, "instructions": "You are a helpful assistant. Be brief.",  # they do not carry over
           "max_output_tokens": 16, "temperature": 0, "extra_headers": TIMING}
    turns = [ada.responses.create(input="My name is Ada and I live in Lisbon, by the sea.", **ask)]
    for question in ("What is my name?", "Where do I live?", "Say both again."):
        turns.append(ada.responses.create(previous_response_id=turns[-1].id, input=question, **ask))
    workers = {t.model_extra["timing"]["decode_worker"] for t in turns}
    assert len(workers) == 1, workers  # round robin alone would alternate between the two
    for before, t in zip(turns, turns[1:]):
        # the history (the last turn's prompt and answer, but a partial block) is that worker's cache
        assert t.usage.input_tokens > before.usage.input_tokens + before.usage.output_tokens
        assert t.usage.input_tokens_details.cached_tokens > before.usage.input_tokens - 16
        assert not t.model_extra["timing"]["prefilled_remotely"]  # only its new tokens, on its worker


def test_another_tenant_cannot_see_or_continue_a_response(ada, bob):
    r = ada.responses.create(model=MODEL, input="A secret: 42.", max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        bob.responses.retrieve(r.id)
    with pytest.raises(openai.BadRequestError) as e:
        bob.responses.create(model=MODEL, previous_response_id=r.id, input="What was the secret?")
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        bob.responses.delete(r.id)
    assert ada.responses.retrieve(r.id).id == r.id


@pytest.mark.parametrize("extra, param, named", [
    ({"tools": [{"type": "web_search"}]}, "tools", "web_search"),
    ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, "input", "reasoning"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
     "input", "input_image"),
    ({"reasoning": {"effort": "low"}}, "reasoning", "reasoning"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice", "file_search"),
    ({"background": True}, "background", "background"),
    ({"conversation": "conv_1"}, "conversation", "conversation"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": 3}}}, "text.format", "text.format"),
    ({"max_output_tokens": -1}, "max_output_tokens", "max_output_tokens"),
])
def test_unsupported_parts_are_refused_by_name(cluster, extra, param, named):
    body = {"model": MODEL, "input": "Hi"} | extra
    r = httpx.post(cluster.url + "/v1/responses", json=body, headers={"Authorization": f"Bearer {KEYS[0]}"},
                   timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and named in err["message"], err
