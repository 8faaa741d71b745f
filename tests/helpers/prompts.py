"""Prompts for the tiny model: random token ids."""
from __future__ import annotations

import random


def prompts(n, seed=0, lo=3, hi=60):
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
