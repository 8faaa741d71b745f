"""The engine at a terminal: one prompt's text as it is generated (`pdserve generate`) and a
chat that keeps its history (`pdserve chat`). Generated text goes to `out`, everything else
to `err`."""
from __future__ import annotations

import sys
import uuid
from typing import Callable, TextIO

from pdserve.engine.core.engine import LLMEngine
from pdserve.common.errors import PdserveError
from pdserve.common.sampling_params import SamplingParams


def stream(engine: LLMEngine, prompt, params: SamplingParams, out: TextIO = sys.stdout) -> str:
    """Run one request, writing its text to `out` as it is produced; Ctrl-C aborts it."""
    rid = uuid.uuid4().hex
    engine.add_request(rid, prompt, params)
    text = []
    try:
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.new_text:
                    out.write(o.new_text)
                    out.flush()
                    text.append(o.new_text)
    except KeyboardInterrupt:
        engine.abort(rid)
    return "".join(text)


def generate(engine: LLMEngine, prompt: str, params: SamplingParams, chat: bool = False,
             out: TextIO = sys.stdout) -> None:
    """One prompt's completion; chat=True wraps it as one user message in the chat template."""
    if chat:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    stream(engine, prompt, params, out)
    out.write("\n")


def chat(engine: LLMEngine, params: SamplingParams, read: Callable[[str], str] = input,
         out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> None:
    """A conversation until end of input: `/reset` starts over; a message the context cannot
    hold is reported and dropped, the conversation goes on."""
    history: list[dict] = []
    print("pdserve chat: type a message, /reset to start over, Ctrl-D to quit", file=err)
    while True:
        try:
            line = read("you> " if sys.stdin.isatty() else "")
        except EOFError:
            return
        if not line.strip():
            continue
        if line.strip() == "/reset":
            history.clear()
            continue
        history.append({"role": "user", "content": line})
        prompt = engine.tokenizer.apply_chat_template(history)
        try:
            reply = stream(engine, prompt, params, out)
        except PdserveError as e:  # e.g. the conversation outgrew the context
            print(f"error: {e}", file=err)
            history.pop()
            continue
        out.write("\n")
        history.append({"role": "assistant", "content": reply})
