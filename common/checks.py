"""Checks at the edges: a typed config's field in its __post_init__ (a bad value is a
ValueError naming it), and JSON's nesting wherever a client's or the model's JSON is parsed."""
from __future__ import annotations

import json
import re
from itertools import accumulate
from typing import Any

MAX_JSON_DEPTH = 64
"""Nesting (objects and arrays) a JSON document may have wherever pdserve parses one: request
bodies, tool-call arguments, a generated tool call. Parsers, validators and templates recurse
per level; Python's own limit (about 1000 frames) would end the request with a RecursionError
at a depth that depends on what else is on the stack."""

# a string, or an unterminated one to the end: every quote starts a match that succeeds, so
# the scan stays linear whatever the text (no retry from each later quote)
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.S)
_OTHER_BYTES = bytes(sorted(set(range(256)) - set(b"[]{}")))
_STEP = [0] * 256  # +1 opens a level, -1 closes one
for _b in b"[{":
    _STEP[_b] = 1
for _b in b"]}":
    _STEP[_b] = -1


def one_of(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")


def at_least(name: str, value: float, low: float) -> None:
    if not value >= low:  # NaN fails too
        raise ValueError(f"{name} must be >= {low:g}, got {value!r}")


def json_depth(doc: bytes | str) -> int:
    """The deepest nesting of `doc`'s arrays and objects, without parsing it (and so without
    recursion): strings are removed by one regular expression, the brackets left are counted
    in C-level loops. Invalid JSON gets some number; its parser refuses it anyway."""
    if isinstance(doc, str):
        doc = doc.encode("utf-8", "surrogatepass")
    brackets = _STRING.sub(b"", doc).translate(None, _OTHER_BYTES)
    return max(accumulate(map(_STEP.__getitem__, brackets)), default=0)


class NestedTooDeeply(ValueError):
    """A JSON document nested past the depth its reader accepts."""


def loads_json(text: str | bytes, what: str = "the JSON", max_depth: int = MAX_JSON_DEPTH) -> Any:
    """json.loads, refusing (NestedTooDeeply, naming `what`) a document nested deeper than
    `max_depth`; otherwise json.loads's own errors (ValueError, TypeError)."""
    depth = json_depth(text)
    if depth > max_depth:
        raise NestedTooDeeply(f"{what} is nested {depth} levels deep; at most {max_depth} are accepted")
    return json.loads(text)
