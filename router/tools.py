"""Structured output and tool calling at the API: `response_format` and `tools`/`tool_choice`
become a `Structured` constraint for the workers, tools are described to the model through the
chat template, and a reply that is a tool call becomes OpenAI `tool_calls`.

A model is told about tools in a system message (templates that render `tools` themselves
get them as a template variable too). It calls one by answering with the JSON object
`{"name": ..., "arguments": {...}}`; with `tool_choice` "required" or a named function that
answer is enforced by a JSON-schema constraint, so the arguments always validate.
"""
from __future__ import annotations

import json
import uuid
from typing import Any

from pdserve.common.checks import NestedTooDeeply, loads_json
from pdserve.common.structured import Structured

from .errors import APIError

TOOL_INSTRUCTIONS = ("You can call these tools (JSON Schema of each one's arguments):\n{tools}\n"
                     "To call a tool, answer with only a JSON object "
                     '{{"name": <tool name>, "arguments": <arguments object>}}; otherwise answer normally.')


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param)


def structured_from_response_format(rf: dict[str, Any] | None) -> Structured | None:
    """OpenAI `response_format` (text, json_object, json_schema) plus the extensions regex,
    choice and grammar (Lark) as a constraint; None for plain text."""
    if rf is None:
        return None
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Structured("json_object")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
            raise _bad("response_format.json_schema.schema must be a JSON Schema object", "response_format")
        return Structured("json_schema", json.dumps(js["schema"]))
    if kind == "regex":
        if not isinstance(rf.get("regex"), str):
            raise _bad("response_format.regex must be a string (a regular expression)", "response_format")
        return Structured("regex", rf["regex"])
    if kind == "choice":
        choices = rf.get("choices")
        if not (isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)):
            raise _bad("response_format.choices must be a non-empty list of strings", "response_format")
        return Structured("choice", json.dumps(choices))
    if kind == "grammar":
        if not isinstance(rf.get("grammar"), str):
            raise _bad("response_format.grammar must be a string (a Lark grammar)", "response_format")
        return Structured("grammar", rf["grammar"])
    raise _bad(f"response_format.type must be one of text, json_object, json_schema, regex, choice, grammar; "
               f"got {kind!r}", "response_format")


def check_tools(tools: list[dict] | None, tool_choice: Any) -> dict[str, dict]:
    """Validate `tools` and `tool_choice`; returns {name: arguments schema}."""
    specs: dict[str, dict] = {}
    for i, t in enumerate(tools or []):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise _bad(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not name or name in specs:
            raise _bad(f"tools[{i}].function.name must be a unique non-empty string", "tools")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise _bad(f"tools[{i}].function.parameters must be a JSON Schema object", "tools")
        if not isinstance(fn.get("description", ""), str):
            raise _bad(f"tools[{i}].function.description must be a string", "tools")
        specs[name] = params
    if tool_choice not in (None, "none", "auto", "required"):
        fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not (isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and isinstance(name, str)):
            raise _bad('tool_choice must be "none", "auto", "required" or '
                       '{"type": "function", "function": {"name": ...}}', "tool_choice")
        if name not in specs:
            raise _bad(f"tool_choice names the function {name!r}, which is not in tools", "tool_choice")
    elif tool_choice == "required" and not specs:
        raise _bad('tool_choice "required" needs at least one tool', "tool_choice")
    return specs


def forced_tool(tools: list[dict] | None, tool_choice: Any, specs: dict[str, dict]) -> Structured | None:
    """The constraint that makes the answer a call of the required (or named) tool."""
    if not specs or tool_choice in (None, "none", "auto"):
        return None
    names = [tool_choice["function"]["name"]] if isinstance(tool_choice, dict) else list(specs)

    def call(name: str) -> dict:
        return {"type": "object", "properties": {"name": {"const": name}, "arguments": specs[name]},
                "required": ["name", "arguments"], "additionalProperties": False}
    schema = call(names[0]) if len(names) == 1 else {"anyOf": [call(n) for n in names]}
    return Structured("json_schema", json.dumps(schema))


def render_messages(messages: list[dict], tools: list[dict] | None, tool_choice: Any) -> list[dict]:
    """Messages for the chat template: assistant tool calls and tool results as text, and the
    tool descriptions in the system message. JSON given to the model is written as UTF-8
    text ("Köln", not "K\\u00f6ln"): escapes are unreadable to it."""
    out = []
    for i, m in enumerate(messages):
        content = m.get("content") or ""
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = [{"name": fn["name"], "arguments": _past_arguments(fn.get("arguments", "{}"), i)}
                     for fn in _call_functions(m["tool_calls"], i)]
            content = "\n".join(json.dumps(c, ensure_ascii=False) for c in calls)
        out.append({"role": m["role"], "content": content})
    if tools and tool_choice != "none":
        described = json.dumps([{"name": t["function"]["name"], "description": t["function"].get("description", ""),
                                 "parameters": t["function"].get("parameters", {})} for t in tools],
                               ensure_ascii=False)
        text = TOOL_INSTRUCTIONS.format(tools=described)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def _past_arguments(text: str, i: int) -> Any:
    """A past call's `arguments` (JSON text) as the model wrote them: the object, or the text
    as it is when it is not JSON; nested past MAX_JSON_DEPTH is refused."""
    try:
        return _loads(text)
    except NestedTooDeeply as e:
        raise _bad(f"messages[{i}].tool_calls: {e}", "messages") from None


def _call_functions(tool_calls: Any, i: int) -> list[dict]:
    """The `function` of each of an assistant message's `tool_calls`, checked for OpenAI's
    shape: a list of {"function": {"name": str, "arguments": str}} objects."""
    shape = (f'messages[{i}].tool_calls must be a list of {{"type": "function", "function": '
             '{"name": <string>, "arguments": <JSON string>}} objects')
    if not isinstance(tool_calls, list):
        raise _bad(shape, "messages")
    out = []
    for c in tool_calls:
        fn = c.get("function") if isinstance(c, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)
                and isinstance(fn.get("arguments", "{}"), str)):
            raise _bad(shape, "messages")
        out.append(fn)
    return out


def _loads(text: str) -> Any:
    """The JSON value of `text`, or `text` itself when it is not JSON; NestedTooDeeply past
    MAX_JSON_DEPTH (json.loads would recurse until a RecursionError)."""
    try:
        return loads_json(text, "the arguments")
    except NestedTooDeeply:
        raise
    except (TypeError, ValueError):
        return text


def parse_tool_call(text: str, specs: dict[str, dict]) -> list[dict] | None:
    """OpenAI `tool_calls` if `text` is a call of one of the tools, else None (and so the
    reply is content): a call nested past MAX_JSON_DEPTH is not taken for one."""
    try:
        doc = _loads(text.strip())
    except NestedTooDeeply:
        return None
    if not (isinstance(doc, dict) and doc.get("name") in specs and isinstance(doc.get("arguments"), dict)):
        return None
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": doc["name"], "arguments": json.dumps(doc["arguments"], ensure_ascii=False)}}]
