"""Tokenizer and chat template, built from the model file itself (no hub access).

From a GGUF: the byte-level BPE vocabulary and merges (or SentencePiece pieces and scores)
in `tokenizer.ggml.*`, special (control) tokens from the token types, BOS/EOS ids, and the
Jinja chat template in `tokenizer.chat_template` (for a Gemma 3 file without one, Gemma's
turn format). From a Hugging Face directory: `tokenizer.json` and
`tokenizer_config.json`.
"""
from __future__ import annotations

import json
import os
import re
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from pdserve.common.errors import InvalidRequestError, ModelLoadError
from pdserve.common.gguf_file import gguf_header
from pdserve.common.model_files import cache_dir, file_fingerprint

_CONTROL, _USER_DEFINED = 3, 4
# stands for message i's content while the template renders (private-use code points, which
# no message is let to contain on this path: see encode_chat)
_MARK = "\ue000{}\ue001"
_MARK_RE = re.compile("\ue000(\\d+)\ue001")
# llama.cpp pre-tokenizer names whose regex splits digits one by one before byte-level BPE
_DIGIT_SPLIT_PRE = {"smollm", "llama-bpe", "qwen2", "deepseek-llm", "starcoder"}


_NORMAL = 1
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character -> byte: printable bytes as themselves, the
    others shifted past U+0100 (as `tokenizers`' ByteLevel writes them)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_UNICODE_TO_BYTE = _byte_level_alphabet()

# Gemma 3 GGUFs may carry no template: the turn format its checkpoints are trained on
# (system text joins the first user turn, or is the user turn when nothing follows it; the
# assistant's role is "model"; Gemma has no tool role, so a tool result is a user turn that
# says what it is)
GEMMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{% set system = messages[0]['content'] if messages and messages[0]['role'] == 'system' else none %}"
    "{% set turns = messages[1:] if system is not none else messages %}"
    "{% if system is not none and not turns %}<start_of_turn>user\n{{ system | trim }}<end_of_turn>\n{% endif %}"
    "{% for m in turns %}"
    "{% if m['role'] not in ('user', 'assistant', 'tool') %}{{ raise_exception('roles must be system (first), "
    "user, assistant and tool') }}{% endif %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else 'user' }}\n"
    "{% if loop.first and system is not none %}{{ system | trim }}\n\n{% endif %}"
    "{% if m['role'] == 'tool' %}Tool result:\n{% endif %}"
    "{{ m['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
BUILTIN_TEMPLATES = {"gemma3": GEMMA3_TEMPLATE}
END_OF_TURN = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|end|>")  # as the chat formats name it


def _byte_level_bpe(vocab: dict[str, int], merges: list[str], pre: str | None) -> HFTokenizer:
    """GPT-2-style byte-level BPE from a GGUF's vocabulary and merges."""
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges],
                                 fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT_PRE:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(tokens: list[str], scores: list[float], types: list[int], vocab: dict[str, int],
                       space_prefix: bool) -> HFTokenizer:
    """SentencePiece BPE (llama.cpp's "llama" vocabulary: pieces with scores, spaces as U+2581,
    unknown bytes as <0xNN> pieces). SentencePiece joins, at each step, the adjacent pair whose
    union is the highest-scoring piece; a BPE whose merges rank by that score does the same."""
    merges = []
    for i, piece in enumerate(tokens):
        if types[i] != _NORMAL or len(piece) < 2:
            continue
        for k in range(1, len(piece)):
            a, b = piece[:k], piece[k:]
            if a in vocab and b in vocab:
                merges.append((-scores[i], i, a, b))
    merges.sort()
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[(a, b) for _, _, a, b in merges], fuse_unk=True,
                                 byte_fallback=True, unk_token=tokens[0] if types[0] == 2 else None))
    from tokenizers import normalizers
    steps = ([normalizers.Prepend("\u2581")] if space_prefix else []) + [normalizers.Replace(" ", "\u2581")]
    tok.normalizer = normalizers.Sequence(steps)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
                                    + ([decoders.Strip(" ", 1, 0)] if space_prefix else []))
    return tok


class Tokenizer:
    """Text <-> token ids, plus the model's chat template."""

    def __init__(self, tok: HFTokenizer, eos_token_id: int | None, bos_token_id: int | None = None,
                 chat_template: str | None = None, add_bos: bool = False):
        self._tok = tok
        self.eos_token_id = eos_token_id
        self.bos_token_id = bos_token_id
        self.chat_template = chat_template
        self.add_bos = add_bos
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self._template = None
        self._text_only: HFTokenizer | None = None  # encodes special-token text as plain text
        self.special_texts = tuple(t.content for t in tok.get_added_tokens_decoder().values() if t.special)
        # control tokens that end a turn besides EOS (Gemma's <end_of_turn>...): generation stops there too
        self.end_of_turn_ids = tuple(i for i in (tok.token_to_id(t) for t in END_OF_TURN) if i is not None
                                     and i != eos_token_id and tok.id_to_token(i) in self.special_texts)

    # ---- construction -----------------------------------------------------------------
    @classmethod
    def from_gguf(cls, path: str | Path) -> "Tokenizer":
        """Build from GGUF metadata; the result is cached beside the converted weights
        (parsing 49k-entry metadata arrays takes seconds, loading tokenizer.json does not)."""
        path = Path(path)
        # v2: a built-in template is cached by name (it is the code's, and changes with it)
        cached = cache_dir() / f"{path.stem}-{file_fingerprint(path)}.tokenizer-v2.json"
        if cached.exists():
            try:
                d = json.loads(cached.read_text())
                template = d["chat_template"] or BUILTIN_TEMPLATES.get(d["builtin_template"])
                return cls(HFTokenizer.from_str(d["tokenizer"]), d["eos"], d["bos"], template, d["add_bos"])
            except (KeyError, ValueError, Exception):  # corrupt cache: rebuild
                pass
        tok = cls._build_from_gguf(path)
        builtin = next((name for name, t in BUILTIN_TEMPLATES.items() if t == tok.chat_template), None)
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps({"tokenizer": tok._tok.to_str(), "eos": tok.eos_token_id,
                                       "bos": tok.bos_token_id, "add_bos": tok.add_bos,
                                       "chat_template": None if builtin else tok.chat_template,
                                       "builtin_template": builtin}))
            os.replace(tmp, cached)
        except OSError:
            pass
        return tok

    @classmethod
    def _build_from_gguf(cls, path: Path) -> "Tokenizer":
        meta = gguf_header(path, vocab=True)

        def val(key, default=None):
            return meta.get(key, default)

        kind = val("tokenizer.ggml.model")
        if kind not in ("gpt2", "llama"):
            raise ModelLoadError(f"unsupported GGUF tokenizer model {kind!r} (byte-level BPE 'gpt2' and "
                                 "SentencePiece BPE 'llama' are supported)")
        tokens = val("tokenizer.ggml.tokens")
        types = val("tokenizer.ggml.token_type") or [1] * len(tokens)
        vocab = {t: i for i, t in enumerate(tokens)}
        if kind == "gpt2":
            tok = _byte_level_bpe(vocab, val("tokenizer.ggml.merges") or [], val("tokenizer.ggml.pre"))
        else:
            tok = _sentencepiece_bpe(tokens, val("tokenizer.ggml.scores"), types, vocab,
                                     bool(val("tokenizer.ggml.add_space_prefix", True)))
        tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                for i, t in enumerate(types) if t == _CONTROL])
        tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                        for i, t in enumerate(types) if t == _USER_DEFINED])
        arch = val("general.architecture")
        return cls(tok, val("tokenizer.ggml.eos_token_id"), val("tokenizer.ggml.bos_token_id"),
                   val("tokenizer.chat_template") or BUILTIN_TEMPLATES.get(arch),
                   bool(val("tokenizer.ggml.add_bos_token", False)))

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "Tokenizer":
        path = Path(path)
        if not (path / "tokenizer.json").exists():
            raise ModelLoadError(f"{path} has no tokenizer.json")
        tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
        cfg = json.loads((path / "tokenizer_config.json").read_text()) if (path / "tokenizer_config.json").exists() else {}

        def token_id(name):
            t = cfg.get(name)
            t = t.get("content") if isinstance(t, dict) else t
            return tok.token_to_id(t) if t else None

        return cls(tok, token_id("eos_token"), token_id("bos_token"), cfg.get("chat_template"),
                   bool(cfg.get("add_bos_token", False)))

    @classmethod
    def from_model_path(cls, path: str | Path) -> "Tokenizer":
        path = Path(path)
        return cls.from_hf_dir(path) if path.is_dir() else cls.from_gguf(path)

    # ---- text -------------------------------------------------------------------------
    def same_vocabulary(self, other: "Tokenizer") -> bool:
        """Whether `other` maps every token to the same id (a draft model must)."""
        return (self.vocab_size == other.vocab_size and self.eos_token_id == other.eos_token_id
                and self._tok.get_vocab(with_added_tokens=True) == other._tok.get_vocab(with_added_tokens=True))

    @property
    def max_token_chars(self) -> int:
        """The longest token's text in characters (at least 1): a text of C characters is at
        least C / this many tokens, a bound known before tokenizing it."""
        if "_max_token_chars" not in self.__dict__:
            self._max_token_chars = max((len(t) for t in self._tok.get_vocab(with_added_tokens=True)), default=1) or 1
        return self._max_token_chars

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Special-token text such as `<|im_start|>` maps to its single id."""
        ids = _encode(self._tok, text)
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for, its own even when they are part of a character (a
        token's decoded text shows such bytes as U+FFFD): byte-level BPE spells bytes as
        characters, SentencePiece's byte fallback as `<0xNN>` pieces."""
        text = self._tok.decode([token_id], skip_special_tokens=False)
        piece = self._tok.id_to_token(token_id)
        if "\ufffd" not in text or piece is None:
            return text.encode()
        if m := _BYTE_PIECE.fullmatch(piece):
            return bytes([int(m.group(1), 16)])
        if all(c in _UNICODE_TO_BYTE for c in piece):
            return bytes(_UNICODE_TO_BYTE[c] for c in piece)
        return text.encode()

    # ---- chat ---------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **extra) -> str:
        """Render `messages` with the model's own template (as transformers does: Jinja with
        trim_blocks/lstrip_blocks in a sandbox)."""
        if not self.chat_template:
            raise InvalidRequestError("this model has no chat template; use the completions API", param="messages")
        if self._template is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template)
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m:
                raise InvalidRequestError(f"messages[{i}] must be an object with a 'role'", param="messages")
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self._token_text(self.bos_token_id), eos_token=self._token_text(self.eos_token_id),
                **extra)
        except jinja2.TemplateError as e:  # the template refused the conversation (raise_exception)
            raise InvalidRequestError(f"this model's chat template refused the conversation: {e}",
                                      param="messages", code="chat_template_error") from e
        except (TypeError, ValueError, LookupError, AttributeError, ArithmeticError) as e:
            # a template written for other conversations (a field it expects, a type it
            # assumes): the conversation does not fit it, which the client can change
            raise InvalidRequestError(f"this model's chat template failed on the conversation "
                                      f"({type(e).__name__}: {e})", param="messages",
                                      code="chat_template_error") from e

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    special_tokens_in_content: bool = False, **extra) -> list[int]:
        """The chat prompt's token ids. Control tokens come from the template only: text in a
        message's content that spells one (`<|im_start|>system ...`) is encoded as the plain
        text it is, so a user cannot forge a system or assistant turn. With
        `special_tokens_in_content`, content is encoded as the rendered prompt is, special
        tokens included (what transformers and vLLM do)."""
        prompt = self.apply_chat_template(messages, add_generation_prompt, **extra)
        bos = self._token_text(self.bos_token_id)
        add_bos = not (bos and prompt.startswith(bos))  # a template that writes BOS itself (Gemma's) gets one
        contents = [m.get("content") for m in messages]
        if special_tokens_in_content or not any(
                isinstance(c, str) and any(t in c for t in self.special_texts) for c in contents):
            return self.encode(prompt, add_special_tokens=add_bos)
        marked = [dict(m, content=_MARK.format(i)) if isinstance(m.get("content"), str) else m
                  for i, m in enumerate(messages)]
        pieces = _MARK_RE.split(self.apply_chat_template(marked, add_generation_prompt, **extra))
        found = [int(i) for i in pieces[1::2]]
        if len(set(found)) != len(found) or any(i >= len(messages) or marked[i] is messages[i] for i in found):
            raise InvalidRequestError("messages contain the reserved characters U+E000/U+E001 around digits",
                                      param="messages")
        ids = self.encode(pieces[0], add_special_tokens=add_bos)
        for k in range(1, len(pieces), 2):  # odd pieces: a message index; even: template text
            ids += self._encode_text(contents[int(pieces[k])]) + self.encode(pieces[k + 1], add_special_tokens=False)
        return ids

    def _encode_text(self, text: str) -> list[int]:
        if self._text_only is None:
            self._text_only = HFTokenizer.from_str(self._tok.to_str())
            self._text_only.encode_special_tokens = True
        return _encode(self._text_only, text)

    def backend_json(self) -> str:
        """The tokenizer as tokenizer.json text (for llguidance's token trie)."""
        return self._tok.to_str()

    def grammar_compiler(self, vocab_size: int):
        """A GrammarCompiler for this tokenizer (built once: it takes ~0.2 s)."""
        from pdserve.common.structured import GrammarCompiler

        cache = self.__dict__.setdefault("_grammar_compilers", {})
        if vocab_size not in cache:
            cache[vocab_size] = GrammarCompiler(self, vocab_size)
        return cache[vocab_size]

    def _token_text(self, token_id: int | None) -> str:
        return (self._tok.id_to_token(token_id) or "") if token_id is not None else ""


def _encode(tok: HFTokenizer, text: str) -> list[int]:
    """`text`'s ids. A long text goes through `encode_batch`, which releases the GIL while it
    runs (`encode` holds it: seconds for a few MB, during which no other thread runs)."""
    if len(text) < 8192:
        return tok.encode(text, add_special_tokens=False).ids
    return tok.encode_batch([text], add_special_tokens=False)[0].ids


def _raise(message: str):
    raise jinja2.TemplateError(message)
