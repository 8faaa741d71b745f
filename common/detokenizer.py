"""Incremental detokenization with stop strings.

Text is released only when it is final: never half of a multi-byte character (byte-level
BPE splits UTF-8 sequences across tokens, and decoding a partial one yields U+FFFD), and
never the first characters of what may still become a stop string. A matched stop string
and everything after it are dropped, as OpenAI does. Before `min_tokens` tokens, stop strings
are not looked for (as EOS and stop token ids are not sampled then).

A character is at most 4 UTF-8 bytes and every token carries at least one byte, so only a
character begun in the last 3 tokens can still be completed: text that ends in U+FFFD
before those is the model's own (invalid bytes) and is released as such. Each push then
decodes a bounded window, and a stream of invalid bytes costs linear time, not quadratic.
"""
from __future__ import annotations

from pdserve.common.tokenizer import Tokenizer

OPEN_TOKENS = 3  # a character begun in the last this many tokens may still be completed


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
        end, full = self._complete()
        if end <= self._read:
            return ""  # an incomplete UTF-8 sequence: wait for its remaining bytes
        prev = self.tok.decode(self.tokens[self._prefix:self._read], self.skip_special)
        self.text += full[len(prev):]
        self._prefix, self._read = self._read, end
        return self._release(final=False)

    def _complete(self) -> tuple[int, str]:
        """(end, text): the most tokens whose text is final, and the text of tokens[_prefix:end].
        All of them unless the last ones begin a character whose bytes may still come; then
        up to those, but never past the last OPEN_TOKENS (see the module's docstring)."""
        n = len(self.tokens)
        for end in range(n, max(self._read, n - OPEN_TOKENS), -1):
            text = self.tok.decode(self.tokens[self._prefix:end], self.skip_special)
            if not text.endswith("\ufffd"):
                return end, text
        end = max(self._read, n - OPEN_TOKENS)
        return end, self.tok.decode(self.tokens[self._prefix:end], self.skip_special)

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
