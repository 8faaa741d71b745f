"""Fuzz by class, against a live in-process cluster serving the real default model: every field
of every request body the router takes (read from its request models, so a field added later
is fuzzed too), and the nested ones a chat carries (content parts, tool calls and their
arguments, tools, tool_choice, response_format, stream_options) and a response's (input
items, function tools, text.format), set to values of every JSON
type, at the edges of every number range, and nested below, at and past the documented
depth (as JSON and as JSON inside a string). The property, for each request:

* never a 5xx, in the status or as a stream's in-band error; every error an OpenAI body;
* never a dropped connection (httpx raises on one); a stream always ends with `[DONE]` (a
  response's with its `response.completed`, `response.incomplete` or `error` event);
* and, after all of them, the router still serves.

Then the cases of those classes that need generation: a generated tool call nested past the
bound, and every choice of a request timed from the request's arrival.
"""
import json
import os

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from pdserve.common.checks import MAX_JSON_DEPTH
from pdserve.deploy.local import LocalCluster
from pdserve.router.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from pdserve.router.responses_api import ResponsesRequest
from tests.helpers.clusters import local_config

pytestmark = pytest.mark.slow
MODEL = "smollm2"
CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"
HOLE = "\ue0ff"  # where the fuzzed value's JSON text goes in a body


@pytest.fixture(scope="module")
def http(smollm):
    loaded, tok = smollm
    c = LocalCluster(loaded, tok, local_config(64 << 20, router={"request_timeout_s": 30.0})).start()
    with httpx.Client(base_url=c.url, timeout=60) as client:
        yield client
    c.stop()
    for eng in c.engines():
        assert eng.blocks.num_used_blocks == 0 and not eng.has_unfinished_requests()


TOOLS = [{"type": "function", "function": {"name": "f", "description": "für Köln",
                                           "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}}]
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
INPUT = [{"role": "system", "content": "Be brief."},
         {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
         {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"x": 1}'},
         {"type": "function_call_output", "call_id": "c1", "output": "ok"}]
BASES = {
    RESPONSES: (ResponsesRequest, {"model": MODEL, "input": INPUT, "max_output_tokens": 2, "store": False,
                                   "tools": [{"type": "function"} | TOOLS[0]["function"]]}),
    "/v1/completions": (CompletionRequest, {"model": MODEL, "prompt": "Hi", "max_tokens": 2}),
    CHAT: (ChatCompletionRequest, {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 2}),
    "/tokenize": (TokenizeRequest, {"model": MODEL, "messages": MESSAGES, "tools": TOOLS}),
    "/detokenize": (DetokenizeRequest, {"model": MODEL, "tokens": [1, 2]}),
}
NESTED_PATHS = [  # the chat's own nested fields (the request models' fields are added below)
    ("messages", 0), ("messages", 1, "role"), ("messages", 1, "content"), ("messages", 1, "content", 0),
    ("messages", 1, "content", 0, "text"), ("messages", 1, "content", 0, "type"), ("messages", 2, "tool_calls"),
    ("messages", 2, "tool_calls", 0), ("messages", 2, "tool_calls", 0, "function"),
    ("messages", 2, "tool_calls", 0, "function", "name"), ("messages", 2, "tool_calls", 0, "function", "arguments"),
    ("messages", 3, "content"), ("messages", 3, "tool_call_id"), ("messages", 3, "name"),
    ("tools", 0), ("tools", 0, "function"), ("tools", 0, "function", "name"),
    ("tools", 0, "function", "description"), ("tools", 0, "function", "parameters"),
    ("tools", 0, "function", "parameters", "properties", "x"), ("tool_choice", "function"),
    ("response_format", "type"), ("response_format", "json_schema"), ("stream_options", "include_usage"),
]
RESPONSE_PATHS = [  # a response's nested fields
    ("input", 0), ("input", 1, "role"), ("input", 1, "content"), ("input", 1, "content", 0),
    ("input", 1, "content", 0, "text"), ("input", 1, "content", 0, "type"), ("input", 2, "type"),
    ("input", 2, "name"), ("input", 2, "arguments"), ("input", 2, "call_id"), ("input", 3, "output"),
    ("input", 3, "call_id"), ("tools", 0), ("tools", 0, "type"), ("tools", 0, "name"), ("tools", 0, "parameters"),
    ("tool_choice", "name"), ("text", "format"), ("text", "format", "type"), ("text", "format", "schema"),
]


def _paths(path: str) -> list[tuple]:
    model, _ = BASES[path]
    out = [(name,) for name in model.model_fields]
    if path in (CHAT, "/tokenize"):
        out += [p for p in NESTED_PATHS if path == CHAT or p[0] in ("messages", "tools")]
    if path == RESPONSES:
        out += RESPONSE_PATHS
    return out


def _deep(depth: int, leaf: str = "1") -> str:
    return "[" * depth + leaf + "]" * depth


NUMBERS = ["0", "-1", "1", "2", "1.5", "-0.0", "1e308", "-1e308", "NaN", "Infinity", "-Infinity",
           str(2**31), str(2**31 - 1), str(2**63), str(-2**63 - 1), str(2**64), "1e400"]
TEXTS = ['""', '"x"', '"\\ud800"', '"\\u0000"', '"<|im_start|>system"', '"9"', '"true"', '"null"', '"für 東京"',
         '"function"', '"text"', '"json_object"', '"f"', json.dumps('{"x": 1}'), json.dumps(_deep(3000))]
OTHERS = ["null", "true", "false", "[]", "{}", "[1]", '["x"]', "[null]", '{"a": 1}', '{"type": "text"}',
          '{"type": "function"}', '{"type": "text", "text": null}', '{"name": "f"}', '[{"type": "text", "text": 1}]']
DEEP = [_deep(d) for d in (MAX_JSON_DEPTH - 3, MAX_JSON_DEPTH, MAX_JSON_DEPTH + 1, 3000)] + [
    '{"a": ' * d + "1" + "}" * d for d in (MAX_JSON_DEPTH - 3, MAX_JSON_DEPTH + 1, 3000)]
VALUES = NUMBERS + TEXTS + OTHERS + DEEP


def _with_hole(body, path: tuple):
    """`body` with HOLE at `path` (containers along it made as needed, a list grown)."""
    if not path:
        return HOLE
    key, rest = path[0], path[1:]
    if isinstance(key, int):
        out = list(body) if isinstance(body, list) else []
        out += [{}] * (key + 1 - len(out))
    else:
        out = dict(body) if isinstance(body, dict) else {}
    out[key] = _with_hole(out[key] if (isinstance(key, int) or key in out) else {}, rest)
    return out


def _tame(path: tuple, value: str) -> str:
    """A valid budget stays small (the property is about answers, not about long generations)."""
    budgets = (("max_tokens",), ("max_completion_tokens",), ("max_output_tokens",), ("n",))
    if path in budgets and value.isdigit() and 4 < int(value) < 2**31:
        return "4"
    return value


def _check(r: httpx.Response, where: str, path: str = CHAT) -> None:
    assert r.status_code < 500, f"{where} -> {r.status_code} {r.text[:1000]}"
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], where
        return
    if r.headers.get("content-type", "").startswith("text/event-stream") and path == RESPONSES:
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1]["type"] in ("response.completed", "response.incomplete", "error"), where
        assert not any(e["type"] == "error" and e["code"] in ("server_error", "internal_error") for e in events), where
    elif r.headers.get("content-type", "").startswith("text/event-stream"):
        data = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert data and data[-1] == "[DONE]", f"{where} -> {r.text[-1000:]}"
        for d in data[:-1]:
            assert json.loads(d).get("error", {}).get("type") != "server_error", f"{where} -> {d}"
    else:
        r.json()


@settings(max_examples=int(os.environ.get("PDSERVE_FUZZ_EXAMPLES", "0") or 0) or 150, deadline=None,
          derandomize=not os.environ.get("PDSERVE_FUZZ_EXAMPLES"), phases=[Phase.explicit, Phase.generate],
          suppress_health_check=list(HealthCheck), database=None)
@given(data=st.data())
def _fuzz_one(http, seen, data):
    path = data.draw(st.sampled_from(sorted(BASES)))
    field = data.draw(st.sampled_from(_paths(path)))
    value = _tame(field, data.draw(st.sampled_from(VALUES)))
    stream = path in (CHAT, "/v1/completions", RESPONSES) and data.draw(st.booleans())
    body = BASES[path][1] | ({"stream": True} if stream else {})
    raw = json.dumps(_with_hole(body, field), ensure_ascii=False).replace(json.dumps(HOLE), value)
    r = http.post(path, content=raw.encode("utf-8", "surrogatepass"), headers={"content-type": "application/json"})
    seen[r.status_code] = seen.get(r.status_code, 0) + 1
    _check(r, f"{path} {field}={value[:80]}", path)


def test_every_field_with_every_kind_of_value(http):
    seen: dict[int, int] = {}
    _fuzz_one(http, seen)
    print(f"statuses {dict(sorted(seen.items()))}")
    assert seen.get(200, 0) > 0 and seen.get(400, 0) > 0, seen  # both served and refused cases were reached


def test_the_router_serves_after_the_fuzzing(http):
    assert http.get("/health").json()["status"] == "ok"
    r = http.post(CHAT, json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.parametrize("stream", [False, True])
def test_a_generated_tool_call_nested_past_the_bound_comes_back_as_content(http, stream):
    """The reply is forced (a regex) to be a call of the tool nested past MAX_JSON_DEPTH: it is
    not taken for a call, and the request is answered, streamed or not."""
    depth = MAX_JSON_DEPTH + 4
    regex = r'\{"name": "f", "arguments": \{"x": ' + r"\[" * depth + "1" + r"\]" * depth + r"\}\}"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Call f."}], "tools": TOOLS,
            "tool_choice": "auto", "response_format": {"type": "regex", "regex": regex}, "max_tokens": 400,
            "temperature": 0, "stream": stream}
    r = http.post(CHAT, json=body)
    _check(r, "deep generated call")
    if stream:
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        assert not any(c["choices"] and c["choices"][0]["delta"].get("tool_calls") for c in chunks)
    else:
        message = r.json()["choices"][0]["message"]
        content = message["content"]
        assert "tool_calls" not in message
    assert content.startswith('{"name": "f"') and content.count("[") == depth, content


def test_every_choice_is_timed_from_the_requests_arrival(http):
    """Choices after the first start once the first has its first token; their queue time and
    TTFT still count from when the request came (what a client waits), not from their start."""
    r = http.post(CHAT, headers={"X-PDServe-Timing": "1"}, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "n": 3})
    assert r.status_code == 200, r.text
    t = sorted(r.json()["timing"], key=lambda c: c["index"])
    for later in t[1:]:
        assert later["queue_s"] >= t[0]["ttft_s"] and later["ttft_s"] >= t[0]["ttft_s"], t
