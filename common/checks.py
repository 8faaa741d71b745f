"""Checks a typed config runs in its __post_init__: a bad value is a ValueError naming it."""
from __future__ import annotations


def one_of(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")


def at_least(name: str, value: float, low: float) -> None:
    if not value >= low:  # NaN fails too
        raise ValueError(f"{name} must be >= {low:g}, got {value!r}")
