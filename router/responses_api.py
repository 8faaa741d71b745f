"""The OpenAI Responses API's request, translated into the chat pipeline's.

A `ResponsesRequest` becomes a `ChatCompletionRequest`: `instructions` a system message,
`input` (a string, or message, `function_call` and `function_call_output` items) chat
messages after the stored conversation it continues, function `tools` and `tool_choice` the
chat's, `text.format` the chat's `response_format` (the same grammar masks), and
`max_output_tokens` its `max_completion_tokens`. What pdserve cannot serve (built-in tools,
reasoning, images, files, background runs) is refused with a 400 naming it. Pure: no I/O.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ValidationError, field_validator

from .errors import APIError, validation_error
from .protocol import STRICT, ChatCompletionRequest, _valid_unicode

TEXT_PARTS = ("input_text", "output_text")
ROLES = ("user", "system", "developer", "assistant")
# the chat pipeline's names for a field, as the Responses API names it (in error messages too)
PARAMS = {"messages": "input", "prompt": "input", "response_format": "text.format",
          "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens"}


class ResponsesRequest(BaseModel):
    """`POST /v1/responses`: the fields pdserve serves; any other is refused by name."""
    model_config = STRICT
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # either way: a reply holds at most one call
    text: dict[str, Any] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    background: bool = False
    # extensions, as on the chat endpoint
    seed: int | None = None
    priority: int = 0

    _unicode_only = field_validator("*")(_valid_unicode)

    def check_supported(self) -> None:
        """What this API has and pdserve does not do: a 400 naming it."""
        if self.background:
            refuse("background responses are not supported", "background")
        if self.truncation == "auto":
            refuse('truncation "auto" is not supported: a conversation longer than the context is refused',
                   "truncation")
        if self.reasoning:
            refuse("reasoning is not supported: the served model is a text model without reasoning", "reasoning")
        if self.include:
            refuse(f"include is not supported (asked for {', '.join(map(str, self.include))})", "include")
        if self.metadata is not None and len(self.metadata) > 16:
            refuse("metadata holds at most 16 keys", "metadata")
        if isinstance(self.input, list) and not self.input and self.previous_response_id is None:
            refuse("input must hold at least one item", "input")


def refuse(message: str, param: str) -> None:
    raise APIError(400, message, param=param)


def chat_request(req: ResponsesRequest, conversation: list[dict]) -> ChatCompletionRequest:
    """The chat request that runs this response: its instructions (a system message; they do
    not carry over to a follow-up), then `conversation` (chat messages: the stored ones this
    response continues, then its input's)."""
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
    body: dict[str, Any] = {"model": req.model, "messages": messages, "user": req.user, "seed": req.seed,
                            "priority": req.priority, "max_completion_tokens": req.max_output_tokens,
                            "tools": chat_tools(req.tools), "tool_choice": chat_tool_choice(req.tool_choice),
                            "response_format": response_format(req.text)}
    if req.temperature is not None:
        body["temperature"] = req.temperature
    if req.top_p is not None:
        body["top_p"] = req.top_p
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        raise renamed(validation_error(e.errors())) from None


def input_messages(items: str | list[dict]) -> list[dict]:
    """`input` as chat messages: consecutive function calls become one assistant message's
    tool calls, each function output a tool message."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            out.append({"role": _role(item, i), "content": _content(item.get("content"), i)})
        elif kind == "function_call":
            call = _function_call(item, i)
            last = out[-1] if out else {}
            if last.get("role") == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": _string(item, "call_id", i),
                        "content": _output(item.get("output"), i)})
        elif kind == "reasoning":
            refuse(f"input[{i}]: reasoning items are not supported (the served model does not reason)", "input")
        else:
            refuse(f"input[{i}]: items of type {str(kind)[:64]!r} are not supported (message, function_call and "
                   "function_call_output are)", "input")
    return out


def _role(item: dict, i: int) -> str:
    role = item.get("role")
    if role not in ROLES:
        refuse(f"input[{i}].role must be one of {', '.join(ROLES)}", "input")
    return role


def _string(item: dict, key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        refuse(f"input[{i}].{key} must be a string", "input")
    return value


def _content(content: Any, i: int) -> str:
    """A message's content as text: a string, or a list of text parts; an image, a file or
    audio is refused by its part type."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        refuse(f"input[{i}].content must be a string or a list of content parts", "input")
    texts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            what = f"{str(kind)[:64]!r} content parts are" if isinstance(kind, str) else "this content part is"
            refuse(f"input[{i}].content[{k}]: {what} not supported (text only: {', '.join(TEXT_PARTS)})",
                   "input")
        if not isinstance(part.get("text"), str):
            refuse(f"input[{i}].content[{k}].text must be a string", "input")
        texts.append(part["text"])
    return "".join(texts)


def _output(output: Any, i: int) -> str:
    """A function's output: a string, or text parts."""
    return output if isinstance(output, str) else _content(output, i)


def _function_call(item: dict, i: int) -> dict:
    """A past `function_call` item as a chat tool call (its `call_id` is the chat call's id)."""
    return {"id": _string(item, "call_id", i), "type": "function",
            "function": {"name": _string(item, "name", i), "arguments": _string(item, "arguments", i)}}


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Function tools (`{"type": "function", "name", "parameters", ...}`) in the chat's
    shape; a built-in tool (web search, file search, ...) is refused by its type."""
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        kind = t.get("type")
        if kind != "function":
            refuse(f"tools[{i}]: {str(kind)[:64]!r} tools are not supported (only function tools are)", "tools")
        fn = {k: t[k] for k in ("name", "description", "parameters") if k in t and t[k] is not None}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: str | dict | None) -> Any:
    """`tool_choice` in the chat's shape: "none" | "auto" | "required" | a named function."""
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") != "function":
        refuse(f"tool_choice of type {str(choice.get('type'))[:64]!r} is not supported (none, auto, required "
               'or {"type": "function", "name": ...})', "tool_choice")
    return {"type": "function", "function": {"name": choice.get("name")}}


def response_format(text: dict | None) -> dict | None:
    """`text.format` as the chat's `response_format`: text, json_object, or json_schema
    (`{"type": "json_schema", "name", "schema", "strict"}`)."""
    if text is None:
        return None
    extra = sorted(set(text) - {"format", "verbosity"})
    if extra:
        refuse(f"unsupported parameter: text.{extra[0]}", f"text.{extra[0]}")
    if text.get("verbosity") not in (None, "medium"):
        refuse("text.verbosity is not supported (the model's answers are as long as it makes them)",
               "text.verbosity")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        refuse("text.format must be an object", "text.format")
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema")}}
    if fmt.get("type") in ("text", "json_object"):
        return {"type": fmt["type"]}
    refuse(f"text.format.type must be text, json_object or json_schema, got {str(fmt.get('type'))[:64]!r}",
           "text.format")


def renamed(e: APIError) -> APIError:
    """A chat pipeline's error with its parameter named as the Responses API names it."""
    head = (e.param or "").split(".")[0]
    if head in PARAMS:
        if head not in ("messages", "prompt"):  # words of the message too; those two are not names there
            e.message = e.message.replace(head, PARAMS[head])
        e.param = PARAMS[head]
    return e
