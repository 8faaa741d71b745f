"""Grammar matchers and token masks: the engine's side of structured output.

`GrammarCompiler` builds one llguidance matcher per request from its `Structured` spec
(`pdserve.common.structured`); before each sampling step the matcher's bitmask sets every
disallowed logit to -inf, and each produced token advances the matcher.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from pdserve.common.structured import GrammarCompiler, Structured


def grammar_state(compiler: GrammarCompiler, structured: Structured) -> "GrammarState":
    """A fresh matcher for one request's constraint; raises InvalidRequestError on a bad one."""
    return GrammarState(compiler.llmatcher(structured), compiler.vocab_size)


def disallowed_rows(states: list["GrammarState"]) -> torch.Tensor:
    """(len(states), vocab) bool: True where a token is NOT allowed next. One unpack for the
    whole batch; each row's bitmask is computed by llguidance without the GIL."""
    vocab = states[0].vocab_size
    words = np.empty((len(states), (vocab + 31) // 32), dtype=np.int32)
    for row, state in zip(words, states):
        state.fill(row)
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    return torch.from_numpy(bits) == 0


class GrammarState:
    """One request's position in its grammar."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.mask_s = 0.0
        """Time spent computing this request's masks so far (its budget is the engine's)."""
        self.last_mask_s = 0.0

    def fill(self, words: np.ndarray) -> None:
        """Write the next-token bitmask (bit t of word t // 32: token t allowed) into `words`,
        a C-contiguous int32 row of (vocab_size + 31) // 32 words."""
        t = time.perf_counter()
        self.matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        self.last_mask_s = time.perf_counter() - t
        self.mask_s += self.last_mask_s

    def over_budget(self, total_s: float, step_s: float) -> str:
        """Why this request's grammar work passed its budget ("": it has not): its masks took
        more than `total_s` in all, or one took more than `step_s` (0: no such limit)."""
        if step_s and self.last_mask_s > step_s:
            return (f"one token's grammar mask took {self.last_mask_s * 1e3:.0f} ms, over the {step_s * 1e3:.0f} ms "
                    "budget: the grammar is too ambiguous for this output (simplify it, e.g. avoid recursive rules "
                    "over single-character lexemes)")
        if total_s and self.mask_s > total_s:
            return (f"the grammar's masks took {self.mask_s:.2f} s in all, over the {total_s:g} s budget of a "
                    "request: the grammar is too ambiguous for this output")
        if self.matcher.is_error():
            return f"the grammar could not continue: {self.matcher.get_error().splitlines()[0]}"
        return ""

    def allowed(self) -> torch.Tensor:
        """Bool mask over the vocabulary of the tokens the grammar accepts next."""
        return disallowed_rows([self])[0].logical_not()

    def consume(self, token: int) -> bool:
        """Advance by `token`; False if the grammar does not allow it."""
        return self.matcher.consume_token(token)

    @property
    def done(self) -> bool:
        """The output is complete: the grammar allows nothing more."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error() if self.matcher.is_error() else ""
