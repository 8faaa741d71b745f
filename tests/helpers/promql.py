"""PromQL as the dashboard and alert checks read it."""
from __future__ import annotations

import re

PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "offset",
                "bool", "inf", "nan"}


def promql_metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers left once strings, label matchers,
    ranges, `by (...)` lists, numbers and function names are taken out."""
    e = re.sub(r'"[^"]*"', "", expr)
    e = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)
    e = re.sub(r"(?<![\w.])\d+(\.\d+)?([eE][+-]?\d+)?", "", e)
    names = set()
    for m in re.finditer(r"[a-zA-Z_:][\w:]*", e):
        if not e[m.end():].lstrip().startswith("(") and m.group().lower() not in PROMQL_WORDS:
            names.add(m.group())
    return names
