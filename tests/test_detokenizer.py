"""The incremental detokenizer on invalid bytes: linear work, and the model's own U+FFFD kept."""
import pytest

from pdserve.common.detokenizer import IncrementalDetokenizer


class CountingTokenizer:
    """The real tokenizer, counting how many token ids it is asked to decode."""

    def __init__(self, tokenizer):
        self.tok, self.decoded = tokenizer, 0

    def decode(self, ids, skip_special_tokens=True):
        self.decoded += len(ids)
        return self.tok.decode(ids, skip_special_tokens)


@pytest.fixture(scope="module")
def lone_byte(tokenizer):
    """A token that is a lone UTF-8 continuation byte: it never completes a character."""
    return next(i for i in range(tokenizer.vocab_size) if tokenizer.decode([i]) == "\ufffd"
                and tokenizer.decode([i, i]) == "\ufffd\ufffd")


def test_a_stream_of_invalid_bytes_is_released_in_linear_time(tokenizer, lone_byte):
    counting = CountingTokenizer(tokenizer)
    det = IncrementalDetokenizer(counting)
    n = 3000
    out = "".join(det.push([lone_byte]) for _ in range(n))
    assert counting.decoded < 40 * n  # each push decodes a bounded window (quadratic: ~n*n/2)
    assert len(out) >= n - 3  # released as it comes, but for the last few that could still complete
    assert out + det.flush() == tokenizer.decode([lone_byte] * n)


def test_characters_split_across_tokens_survive_invalid_bytes_around_them(tokenizer, lone_byte):
    emoji = tokenizer.encode("🎉")
    assert len(emoji) > 1
    ids = [lone_byte] * 5 + emoji + tokenizer.encode(" ok") + [lone_byte] * 2 + emoji
    for batch in (1, 3, len(ids)):  # one token a push, a few (speculation), all at once
        det = IncrementalDetokenizer(tokenizer)
        pieces = [det.push(ids[i:i + batch]) for i in range(0, len(ids), batch)] + [det.flush()]
        assert "".join(pieces) == tokenizer.decode(ids)
        assert "".join(pieces).count("🎉") == 2
