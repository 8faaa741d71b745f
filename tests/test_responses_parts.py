"""The Responses API's parts without a model: the store's bounds and tenant scoping (in
memory and in a real Redis), the translation of input items into chat messages, and the
stream's events for a held tool call and for a failure."""
import asyncio
import json

import pytest
import redis.asyncio as aioredis

from pdserve.registry.embedded import EmbeddedRedis
from pdserve.router.errors import APIError
from pdserve.router.response_store import MemoryResponseStore, RedisResponseStore, ResponseStore, StoredResponse
from pdserve.router.responses_api import ResponsesRequest, chat_request, input_messages
from pdserve.router.responses_output import ResponseEvents, Turn, response_object


def stored(n: int) -> StoredResponse:
    return StoredResponse({"id": f"resp_{n}"}, [{"role": "user", "content": str(n)}], "resp_0")


async def bounded_by_count_and_age(backend) -> None:
    store = ResponseStore(backend)
    for n in range(3):
        await store.put("ada", f"resp_{n}", stored(n))
    assert await store.get("ada", "resp_0") is None  # the oldest went first
    assert (await store.get("ada", "resp_2")).conversation == [{"role": "user", "content": "2"}]
    assert await store.get("bob", "resp_2") is None  # another tenant's does not exist to bob
    assert not await store.delete("bob", "resp_2") and await store.get("ada", "resp_2") is not None
    assert await store.delete("ada", "resp_2") and await store.get("ada", "resp_2") is None
    assert await store.get("ada", "x" * 300) is None  # not an id: not found, nothing asked
    await asyncio.sleep(1.2)
    assert await store.get("ada", "resp_1") is None  # past its age


def test_memory_store_is_bounded_and_per_tenant():
    asyncio.run(bounded_by_count_and_age(MemoryResponseStore(max_age_s=1, max_per_tenant=2)))


def test_redis_store_is_bounded_and_per_tenant():
    async def run(url: str) -> None:
        db = aioredis.from_url(url)
        try:
            await bounded_by_count_and_age(RedisResponseStore(db, "t", max_age_s=1, max_per_tenant=2))
            assert await db.keys("pdserve:t:response:*") == []  # nothing left behind
        finally:
            await db.aclose()
    with EmbeddedRedis() as r:
        asyncio.run(run(r.url))


def test_an_unreachable_redis_is_a_503():
    async def run() -> None:
        db = aioredis.from_url("redis://127.0.0.1:1/0")
        try:
            with pytest.raises(APIError) as e:
                await ResponseStore(RedisResponseStore(db, "t")).get("ada", "resp_1")
            assert e.value.status == 503 and e.value.code == "store_unavailable"
        finally:
            await db.aclose()
    asyncio.run(run())


def test_input_items_become_chat_messages():
    items = [{"type": "message", "role": "developer", "content": "Be brief."},
             {"role": "user", "content": [{"type": "input_text", "text": "Weather in "}, {"type": "input_text",
                                                                                          "text": "Paris and Rome?"}]},
             {"type": "function_call", "call_id": "call_1", "name": "w", "arguments": '{"city": "Paris"}'},
             {"type": "function_call", "call_id": "call_2", "name": "w", "arguments": '{"city": "Rome"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
             {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "rain"}]}]
    messages = input_messages(items)
    assert [m["role"] for m in messages] == ["developer", "user", "assistant", "tool", "tool"]
    assert messages[1]["content"] == "Weather in Paris and Rome?"
    assert [c["id"] for c in messages[2]["tool_calls"]] == ["call_1", "call_2"]  # one turn with both calls
    assert messages[4] == {"role": "tool", "tool_call_id": "call_2", "content": "rain"}
    req = ResponsesRequest(model="m", input="Hi", instructions="Answer in French.", max_output_tokens=5,
                           tools=[{"type": "function", "name": "w", "parameters": {"type": "object"}}],
                           tool_choice={"type": "function", "name": "w"})
    chat = chat_request(req, [{"role": "user", "content": "Hi"}])
    assert [m.role for m in chat.messages] == ["system", "user"] and chat.max_new_tokens() == 5
    assert chat.tool_choice == {"type": "function", "function": {"name": "w"}}
    assert chat.tools == [{"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}]


def events_of(sse: str) -> list[dict]:
    return [json.loads(line[6:]) for line in sse.splitlines() if line.startswith("data: ")]


def test_a_held_tool_call_streams_as_a_function_call():
    req = ResponsesRequest(model="m", input="Hi")
    events = ResponseEvents(response_object("resp_1", req, "m", 0), "msg_1")
    call = {"id": "call_1", "type": "function", "function": {"name": "w", "arguments": '{"city": "Paris"}'}}
    sent = events_of(events.encode(events.start()) + events.encode(events.finish(Turn("...", [call], "stop"))))
    assert [e["type"] for e in sent] == ["response.created", "response.in_progress", "response.output_item.added",
                                         "response.function_call_arguments.delta",
                                         "response.function_call_arguments.done", "response.output_item.done"]
    assert [e["sequence_number"] for e in sent] == list(range(6))
    assert sent[-1]["item"] == {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "w",
                                "arguments": '{"city": "Paris"}', "status": "completed"}


def test_a_failed_stream_ends_with_an_error_event():
    req = ResponsesRequest(model="m", input="Hi")
    events = ResponseEvents(response_object("resp_1", req, "m", 0), "msg_1")
    text = events.encode(events.delta("Hel"))
    text += events.encode(APIError(503, "decode worker d0 failed", "server_error", code="worker_failed").body())
    assert text.endswith("\n\n") and "\nevent: error\ndata: " in text and events.failed
    assert events_of(text)[-1] == {"type": "error", "code": "worker_failed", "message": "decode worker d0 failed",
                                   "param": None, "sequence_number": 3}
