"""The one check that token ids are in a vocabulary, for every place ids come in from outside
(API prompts, /detokenize, an engine's prompt and resumed tokens, logit bias and stop ids)."""
from __future__ import annotations

from collections.abc import Iterable

from pdserve.common.errors import InvalidRequestError


def check_token_ids(ids: Iterable, vocab_size: int, param: str, what: str | None = None) -> None:
    """Raise InvalidRequestError naming the first id that is not an integer in [0, vocab_size).
    `what`: how the message names the ids (default: the parameter)."""
    bad = next((t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(f"{what or param} contains token id {bad!r}, outside the vocabulary "
                                  f"[0, {vocab_size})", param=param)
