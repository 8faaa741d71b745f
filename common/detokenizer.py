"""Incremental detokenization with stop strings.

Text is released only when it is final: never half of a multi-byte character (byte-level
BPE splits UTF-8 sequences across tokens, and decoding a partial one yields U+FFFD), and
never the first characters of what may still become a stop string. A matched stop string
and everything after it are dropped, as OpenAI does. Before `min_tokens` tokens, stop strings
are not looked for (as EOS and stop token ids are not sampled then).
"""
from __future__ import annotations

from pdserve.common.tokenizer import Tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: list[str] | None = None,
                 skip_special_tokens: bool = True, min_tokens: int = 0):
        self.tok = tokenizer
        self.stop = list(stop or [])
        self.skip_special = skip_special_tokens
        self.tokens: list[int] = []
        self._prefix = 0  # tokens[_prefix:_read] decode to text already in self.text
        self._read = 0
        self.text = ""        # decoded so far (complete characters only)
        self._released = 0    # len of text already returned to the caller
        self.stopped_on: str | None = None
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.min_tokens = min_tokens

    def push(self, token_ids: list[int]) -> str:
        """Add generated tokens; return the newly final text (possibly empty)."""
        if self.stopped_on is not None:
            return ""
        self.tokens.extend(token_ids)
        prev = self.tok.decode(self.tokens[self._prefix:self._read], self.skip_special)
        full = self.tok.decode(self.tokens[self._prefix:], self.skip_special)
        if full.endswith("\ufffd"):
            return ""  # an incomplete UTF-8 sequence: wait for its remaining bytes
        self.text += full[len(prev):]
        self._prefix, self._read = self._read, len(self.tokens)
        return self._release(final=False)

    def flush(self) -> str:
        """At the end of generation: release everything held back."""
        if self.stopped_on is None and self._read < len(self.tokens):
            prev = self.tok.decode(self.tokens[self._prefix:self._read], self.skip_special)
            self.text += self.tok.decode(self.tokens[self._prefix:], self.skip_special)[len(prev):]
            self._read = len(self.tokens)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if len(self.tokens) < self.min_tokens:  # no stop yet: nothing to hold back for one
            final = True
        elif self.stop and self.stopped_on is None:
            # a stop string may straddle what was released and the new text
            start = max(0, self._released - self._hold)
            hits = [(self.text.find(s, start), s) for s in self.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                i, s = min(hits)
                self.text = self.text[:i]
                self.stopped_on = s
                final = True
        end = len(self.text) if final else max(self._released, len(self.text) - self._hold)
        out = self.text[self._released:end]
        self._released = end
        return out
