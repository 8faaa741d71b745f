"""Grammar matchers and token masks: the engine's side of structured output.

`GrammarCompiler` builds one llguidance matcher per request from its `Structured` spec
(`pdserve.common.structured`); before each sampling step the matcher's bitmask sets every
disallowed logit to -inf, and each produced token advances the matcher.
"""
from __future__ import annotations

import numpy as np
import torch

from pdserve.common.errors import InvalidRequestError
from pdserve.common.structured import GrammarCompiler, Structured


def grammar_state(compiler: GrammarCompiler, structured: Structured) -> "GrammarState":
    """A fresh matcher for one request's constraint; raises InvalidRequestError on a bad one."""
    return GrammarState(compiler.llmatcher(structured), compiler.vocab_size)


def disallowed_rows(states: list["GrammarState"]) -> torch.Tensor:
    """(len(states), vocab) bool: True where a token is NOT allowed next. One unpack for the
    whole batch; each row's bitmask is computed by llguidance without the GIL."""
    vocab = states[0].vocab_size
    words = np.empty((len(states), (vocab + 31) // 32), dtype=np.int32)
    for row, s in zip(words, states):
        s.fill(row)
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    return torch.from_numpy(bits) == 0


class GrammarState:
    """One request's position in its grammar."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher = matcher
        self.vocab_size = vocab_size

    def fill(self, words: np.ndarray) -> None:
        """Write the next-token bitmask (bit t of word t // 32: token t allowed) into `words`,
        a C-contiguous int32 row of (vocab_size + 31) // 32 words."""
        self.matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)

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
