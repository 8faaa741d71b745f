"""Speculative decoding without a draft model (prompt lookup): a request's next tokens are
guessed by finding the latest earlier occurrence of its last few tokens in its own prompt and
output, and the guesses are checked in the same forward pass as the real next token. Output
that copies its input (code edits, quoting summaries, extraction) then advances several
tokens per step. Exact for greedy requests: a guess is kept only where it equals the argmax
the model gives at that position, and the first disagreement is replaced by that argmax.
"""
from __future__ import annotations

import torch

from pdserve.engine.core.scheduler import ScheduledChunk, SchedulerOutput


def propose(tokens: list[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix
    n-gram (max_ngram down to min_ngram) of `tokens`; [] if none recurs."""
    for n in range(max_ngram, min_ngram - 1, -1):
        if len(tokens) <= n:
            continue
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # latest occurrence first
            if tokens[start:start + n] == tail:
                return tokens[start + n:start + n + k]
    return []


def accepted(proposals: list[int], targets: list[int]) -> int:
    """How many leading proposals equal the model's greedy choice at their position."""
    j = 0
    while j < len(proposals) and proposals[j] == targets[j]:
        j += 1
    return j


class NgramSpeculator:
    """Extends eligible decode chunks of a scheduled step with up to `k` guessed tokens."""

    kind = "prompt-lookup"

    def __init__(self, k: int, block_manager, max_model_len: int, token_budget: int):
        self.k, self.blocks = k, block_manager
        self.max_model_len, self.token_budget = max_model_len, token_budget
        self.proposed = self.accepted = 0

    @staticmethod
    def eligible(req) -> bool:
        p = req.params  # the check is exact only for plain greedy decoding
        return (p.greedy and not p.has_penalties and p.logprobs is None and p.prompt_logprobs is None
                and req.grammar is None)

    def release(self, request_id: str) -> None:
        """Nothing is kept per request."""

    def extend(self, sched: SchedulerOutput, held: set[str]) -> dict[str, list[int]]:
        """Append guesses to eligible requests (provisionally: `settle` takes back the rejected
        ones) and widen their chunks; returns request id -> guesses."""
        room = self.token_budget - sched.num_tokens
        guesses: dict[str, list[int]] = {}
        for i, c in enumerate(sched.chunks):
            req = c.request
            if room <= 0 or c.num_new_tokens != 1 or req.request_id in held or not self.eligible(req):
                continue
            left = min(req.max_tokens - len(req.output_token_ids) - 1, self.max_model_len - req.num_tokens, room)
            g = propose(req.all_token_ids, min(self.k, left)) if left > 0 else []
            if not g:
                continue
            req.all_token_ids.extend(g)
            if not self.blocks.allocate(req.request_id, req.num_tokens):
                del req.all_token_ids[-len(g):]  # no room for their KV: decode normally
                continue
            sched.chunks[i] = ScheduledChunk(req, 1 + len(g), True)
            guesses[req.request_id] = g
            room -= len(g)
        return guesses

    def settle(self, req, guesses: list[int], logits: torch.Tensor) -> list[int]:
        """Given the logits of the widened chunk's rows, take back the provisional tokens and
        return the tokens to emit: the accepted guesses, then the model's own next token."""
        targets = torch.argmax(logits, dim=-1).tolist()
        j = accepted(guesses, targets)
        real = req.num_tokens - len(guesses)
        del req.all_token_ids[real:]
        req.num_computed_tokens = real + j  # KV is valid through the last accepted guess
        self.proposed += len(guesses)
        self.accepted += j
        return guesses[:j] + [targets[j]]
