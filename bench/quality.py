"""Quality measures shared by the numerics benchmarks: perplexity on a fixed text from the
engine's prompt logprobs, and greedy agreement between two sets of generations."""
from __future__ import annotations

import math
import statistics

from pdserve.common.sampling_params import SamplingParams

PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain what a hash table is.",
    "Give me three tips for a job interview.", "How do vaccines work?", "Translate 'good morning' into Spanish.",
    "What is 17 times 23?", "Summarize the plot of Romeo and Juliet.", "Write a Python function that reverses a string.",
    "Why is the sky blue?", "List the planets of the solar system.", "What causes earthquakes?",
    "Describe a cat to someone who has never seen one.", "What is the difference between RAM and disk?",
    "Write a short email asking for a day off.", "What is photosynthesis?",
]


def perplexity(engine, ids: list[int], window: int = 512) -> float:
    """exp of the mean negative log-likelihood of `ids`, in windows of `window` tokens (each
    scored from its own start), from the engine's prompt logprobs."""
    nll, n = 0.0, 0
    for i, start in enumerate(range(0, len(ids) - 1, window)):
        chunk = ids[start:start + window]
        if len(chunk) < 2:
            break
        engine.add_request(f"ppl-{i}", chunk, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.prompt_logprobs:
                    nll -= sum(lp.logprob for lp in out.prompt_logprobs)
                    n += len(out.prompt_logprobs)
    return math.exp(nll / n)


def agreement(ref: list[list[int]], got: list[list[int]]) -> dict:
    """Share of outputs identical to `ref`'s, and the mean share of tokens before the first divergence."""
    prefix = []
    for a, b in zip(ref, got):
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix.append(k / max(len(a), 1))
    return {"identical": sum(a == b for a, b in zip(ref, got)) / len(ref), "mean_prefix_share": statistics.mean(prefix)}
