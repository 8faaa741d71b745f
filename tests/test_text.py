"""Incremental detokenization (multi-byte safe), stop strings, and the chat template."""
import pytest

from pdserve.common.detokenizer import IncrementalDetokenizer
from pdserve.common.errors import InvalidRequestError

TEXTS = ["Hello, world!", "naïve café — 東京タワー 🎉🚀👩‍💻 done", "数字と絵文字🙂が混在", "tabs\tand\nnewlines  ok"]


@pytest.mark.parametrize("text", TEXTS)
def test_streaming_never_emits_broken_characters(tokenizer, text):
    ids = tokenizer.encode(text)
    det = IncrementalDetokenizer(tokenizer)
    pieces = [det.push([t]) for t in ids] + [det.flush()]
    assert all("\ufffd" not in p for p in pieces), pieces
    assert "".join(pieces) == text


def test_multibyte_character_split_across_tokens_is_held(tokenizer):
    ids = tokenizer.encode("🎉")
    assert len(ids) > 1  # byte-level BPE splits this emoji's 4 bytes
    det = IncrementalDetokenizer(tokenizer)
    assert [det.push([t]) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert det.push(ids[-1:]) == "🎉"


def test_stop_string_straddling_tokens_is_cut(tokenizer):
    text = "The answer is 42. STOP here and more text"
    ids = tokenizer.encode(text)
    det = IncrementalDetokenizer(tokenizer, stop=["STOP"])
    out = ""
    for t in ids:
        out += det.push([t])
        if det.stopped_on:
            break
    out += det.flush()
    assert out == "The answer is 42. " and det.stopped_on == "STOP"


def test_earliest_stop_string_wins_and_text_before_is_released(tokenizer):
    ids = tokenizer.encode("alpha beta gamma delta")
    det = IncrementalDetokenizer(tokenizer, stop=["delta", "beta"])
    out = "".join(det.push([t]) for t in ids) + det.flush()
    assert out == "alpha " and det.stopped_on == "beta"


def test_stop_strings_are_not_looked_for_before_min_tokens(tokenizer):
    ids = tokenizer.encode("beta one beta two")
    first = len(tokenizer.encode("beta one"))
    det = IncrementalDetokenizer(tokenizer, stop=["beta"], min_tokens=first)
    out = "".join(det.push([t]) for t in ids) + det.flush()
    assert out == "beta one " and det.stopped_on == "beta"  # the 1st is within min_tokens, the 2nd stops it


def test_special_tokens_skipped_in_output(tokenizer):
    det = IncrementalDetokenizer(tokenizer)
    ids = tokenizer.encode("Hi there<|im_end|>")
    assert ids[-1] == tokenizer.eos_token_id
    assert "".join(det.push([t]) for t in ids) + det.flush() == "Hi there"


def test_special_token_text_encodes_to_one_id(tokenizer):
    assert tokenizer.encode("<|im_start|>") == [1]
    assert tokenizer.encode("<|im_end|>") == [2]


def test_chat_template_generation_prompt(tokenizer):
    msgs = [{"role": "user", "content": "Hi"}]
    with_prompt = tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
    without = tokenizer.apply_chat_template(msgs, add_generation_prompt=False)
    assert with_prompt == without + "<|im_start|>assistant\n"
    assert "<|im_start|>user\nHi<|im_end|>" in without
    assert without.startswith("<|im_start|>system\n")  # the template's default system prompt


def test_chat_template_rejects_malformed_messages(tokenizer):
    with pytest.raises(InvalidRequestError, match="role"):
        tokenizer.apply_chat_template([{"content": "no role"}])
