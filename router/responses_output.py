"""What a response produced, in the Responses API's shapes: the output items (a message, or
a function call), the response object with its usage, and the stream's events in order
(`response.created` ... `response.completed`, or an `error` event), each with its
`sequence_number`. Pure: the endpoint (router/responses_endpoint.py) feeds it."""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

from .responses_api import ResponsesRequest


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class Turn:
    """One response's answer: its text, or the tool calls it is (chat `tool_calls`)."""
    text: str
    calls: list[dict] | None
    finish_reason: str

    @property
    def complete(self) -> bool:
        return self.finish_reason != "length"

    def assistant_message(self) -> dict:
        """The answer as the chat message a follow-up's conversation holds."""
        if self.calls:
            return {"role": "assistant", "content": None, "tool_calls": self.calls}
        return {"role": "assistant", "content": self.text}


def message_item(item_id: str, text: str, status: str) -> dict:
    content = [] if status == "in_progress" else [{"type": "output_text", "text": text, "annotations": [],
                                                   "logprobs": []}]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def call_item(call: dict, arguments: str | None = None, status: str = "completed") -> dict:
    """A chat tool call as a `function_call` item (its chat id is the item's `call_id`)."""
    fn = call["function"]
    return {"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"), "call_id": call["id"],
            "name": fn["name"], "arguments": fn["arguments"] if arguments is None else arguments, "status": status}


def output_items(turn: Turn, msg_id: str) -> list[dict]:
    if turn.calls:
        return [call_item(c) for c in turn.calls]
    return [message_item(msg_id, turn.text, "completed" if turn.complete else "incomplete")]


def usage(gen_usage: dict) -> dict:
    """A generation's usage (chat's names) under the Responses API's names."""
    cached = gen_usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return {"input_tokens": gen_usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": gen_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": gen_usage["total_tokens"]}


def text_format(req: ResponsesRequest) -> dict:
    fmt = (req.text or {}).get("format") or {"type": "text"}
    return {"format": fmt}


def response_object(rid: str, req: ResponsesRequest, model: str, created_at: int, status: str = "in_progress",
                    output: list[dict] | None = None, usage_: dict | None = None) -> dict:
    """The response object (as `POST`, `GET` and the stream's lifecycle events show it); the
    request's settings echoed with the defaults they ran with."""
    return {"id": rid, "object": "response", "created_at": created_at, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": model,
            "output": output or [], "parallel_tool_calls": True if req.parallel_tool_calls is None
            else req.parallel_tool_calls, "previous_response_id": req.previous_response_id, "reasoning": None,
            "store": req.store, "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": text_format(req), "tool_choice": req.tool_choice or "auto", "tools": req.tools or [],
            "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": req.truncation or "disabled",
            "usage": usage_, "user": req.user, "metadata": req.metadata or {}}


def finished(rid: str, req: ResponsesRequest, model: str, created_at: int, turn: Turn, msg_id: str,
             gen_usage: dict) -> dict:
    """The finished response: completed, or incomplete when it ran into max_output_tokens."""
    status = "completed" if turn.complete or turn.calls else "incomplete"
    return response_object(rid, req, model, created_at, status, output_items(turn, msg_id), usage(gen_usage))


class ResponseEvents:
    """One response's stream events. Text streams as it comes (the message item and its
    part are opened at the first delta); an answer that may be a tool call is held until it
    is complete (only then is it known to be one) and streams as a function call or as text."""

    def __init__(self, snapshot: dict, msg_id: str):
        self.snapshot, self.msg_id = snapshot, msg_id
        self.sequence = 0
        self.opened = False
        self.text = ""
        self.failed = False

    def encode(self, events) -> str:
        """SSE text of an event, a list of them, or a failed stream's error body."""
        if isinstance(events, dict) and "error" in events:
            self.failed = True
            err = events["error"]
            events = [{"type": "error", "code": err.get("code") or err.get("type"), "message": err.get("message"),
                       "param": err.get("param")}]
        out = []
        for ev in events if isinstance(events, list) else [events]:
            ev = ev | {"sequence_number": self.sequence}
            self.sequence += 1
            out.append(f"event: {ev['type']}\ndata: {json.dumps(ev, ensure_ascii=False)}\n\n")
        return "".join(out)

    def start(self) -> list[dict]:
        return [{"type": "response.created", "response": self.snapshot},
                {"type": "response.in_progress", "response": self.snapshot}]

    def _open(self) -> list[dict]:
        if self.opened:
            return []
        self.opened = True
        ids = {"item_id": self.msg_id, "output_index": 0, "content_index": 0}
        return [{"type": "response.output_item.added", "output_index": 0,
                 "item": message_item(self.msg_id, "", "in_progress")},
                {"type": "response.content_part.added"} | ids | {"part": self._part("")}]

    @staticmethod
    def _part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def delta(self, text: str) -> list[dict]:
        """A piece of the answer's text as it comes."""
        self.text += text
        return self._open() + [{"type": "response.output_text.delta", "item_id": self.msg_id, "output_index": 0,
                                "content_index": 0, "delta": text, "logprobs": []}]

    def finish(self, turn: Turn) -> list[dict]:
        """The answer's closing events: its function calls, or the rest of its text and the
        message's done events."""
        if turn.calls:
            return [e for k, c in enumerate(turn.calls) for e in self._call(k, c)]
        rest = turn.text[len(self.text):]  # all of it when it was held
        events = self.delta(rest) if rest or not self.opened else []
        ids = {"item_id": self.msg_id, "output_index": 0, "content_index": 0}
        status = "completed" if turn.complete else "incomplete"
        return events + [{"type": "response.output_text.done"} | ids | {"text": turn.text, "logprobs": []},
                         {"type": "response.content_part.done"} | ids | {"part": self._part(turn.text)},
                         {"type": "response.output_item.done", "output_index": 0,
                          "item": message_item(self.msg_id, turn.text, status)}]

    @staticmethod
    def _call(k: int, call: dict) -> list[dict]:
        item = call_item(call)
        ids = {"item_id": item["id"], "output_index": k}
        return [{"type": "response.output_item.added", "output_index": k,
                 "item": call_item(call, "", "in_progress")},
                {"type": "response.function_call_arguments.delta"} | ids | {"delta": item["arguments"]},
                {"type": "response.function_call_arguments.done"} | ids | {"arguments": item["arguments"],
                                                                          "name": item["name"]},
                {"type": "response.output_item.done", "output_index": k, "item": item}]

    @staticmethod
    def end(response: dict) -> dict:
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        return {"type": kind, "response": response}


def now() -> int:
    return int(time.time())
