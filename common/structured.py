"""Structured output's spec: which constraint a request names, validated and turned into
llguidance's grammar text (no torch or numpy here; the engine's matchers and masks are in
`pdserve.engine.sampling.grammar`).

A grammar constrains which tokens may come next.

A request's `SamplingParams.structured` names a constraint (a JSON schema, any JSON object, a
regex, a choice among strings, or a Lark grammar). The engine compiles it with llguidance
for the model's tokenizer and keeps one matcher per request: before each sampling step the
matcher's token bitmask sets every disallowed logit to -inf, and each produced token
advances the matcher. The matcher's state is a function of the tokens produced so far, so
it crosses process boundaries by replay: the prefill worker masks the first token, the
decode worker rebuilds the matcher from the constraint and consumes that token (and, after a
migration, every token already streamed).

llguidance was picked over xgrammar by `bench/experiments/grammar_backends.py`: both compute a mask in
microseconds on this CPU (a decode step takes tens of milliseconds); llguidance compiles
faster and needs nothing else installed (xgrammar pulls in transformers and triton).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from pdserve.common.checks import loads_json
from pdserve.common.errors import InvalidRequestError

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
# JSON with fixed separators and no free whitespace: flexible whitespace lets a small model
# loop on newlines until max_tokens and leave the document unfinished; this way a bounded
# schema always ends within a bounded number of tokens
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# a JSON number's digits, bounded as llama.cpp's schema grammars bound them: an IEEE double holds
# no more, and a small model left free can write digits until max_tokens and leave the
# document unfinished (seen: a latitude's fraction running on for 190 digits)
SAFE_INTEGER = 2 ** 53 - 1
NUMBER_STEP = 1e-10  # <= 10 digits after the point, no exponent (`multipleOf`; llguidance takes no finer)
MAX_SPEC_BYTES = 64 << 10
STEP_MAX_ITEMS = 20_000

# where a JSON schema holds subschemas: maps of them, single ones, lists of them
_SUB_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUB_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames",
            "unevaluatedItems", "additionalProperties")
_SUB_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")


def strict_schema(schema):
    """The schema as generation should follow it: an object schema that lists its
    `properties` and says nothing of others gets `additionalProperties: false` (as
    xgrammar's strict mode, and OpenAI's strict function calling, do). JSON Schema allows
    unlisted properties by default, and with that freedom a model keeps adding them until
    max_tokens and never closes the object; a schema that wants them says so
    (`additionalProperties`, `patternProperties` or `unevaluatedProperties`). A number or
    integer without bounds of its own gets +-SAFE_INTEGER, a number without `multipleOf` gets
    NUMBER_STEP: its digits are finite, as an IEEE double's are."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUB_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: strict_schema(sub) for name, sub in out[key].items()}
    for key in _SUB_ONE:
        if isinstance(out.get(key), dict):
            out[key] = strict_schema(out[key])
    for key in _SUB_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [strict_schema(sub) for sub in out[key]]
    if isinstance(out.get("properties"), dict) and not {
            "additionalProperties", "patternProperties", "unevaluatedProperties"} & out.keys():
        out["additionalProperties"] = False
    kinds = out.get("type")
    kinds = set(kinds) if isinstance(kinds, list) else {kinds}
    if kinds & {"number", "integer"}:
        if not {"minimum", "exclusiveMinimum"} & out.keys():
            out["minimum"] = -SAFE_INTEGER
        if not {"maximum", "exclusiveMaximum"} & out.keys():
            out["maximum"] = SAFE_INTEGER
        if "number" in kinds and "multipleOf" not in out:
            out["multipleOf"] = NUMBER_STEP
    return out


@dataclass(frozen=True)
class Structured:
    """A constraint on the output. `spec`: the JSON schema (as JSON text) for json_schema,
    the pattern for regex, a JSON list of strings for choice, Lark text for grammar."""
    kind: str
    spec: str = ""

    def validate(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequestError(f"structured output kind must be one of {KINDS}, got {self.kind!r}",
                                      param="response_format")
        if len(self.spec.encode()) > MAX_SPEC_BYTES:
            raise InvalidRequestError(f"the {self.kind} constraint is larger than {MAX_SPEC_BYTES} bytes",
                                      param="response_format")

    def grammar(self) -> str:
        """The llguidance grammar text; raises InvalidRequestError on a malformed spec (a JSON
        one nested past MAX_JSON_DEPTH included: strict_schema recurses per level)."""
        from llguidance import LLMatcher

        try:
            if self.kind == "json_object":
                return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
            if self.kind == "json_schema":
                return LLMatcher.grammar_from_json_schema(strict_schema(loads_json(self.spec, "the schema")), overrides=JSON_OPTIONS)
            if self.kind == "regex":
                return LLMatcher.grammar_from_regex(self.spec)
            if self.kind == "choice":
                choices = loads_json(self.spec, "the choices")
                if not (isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)):
                    raise ValueError("choice needs a non-empty list of strings")
                return LLMatcher.grammar_from_regex("|".join(f"({re.escape(c)})" for c in choices))
            return LLMatcher.grammar_from_lark(self.spec)
        except (ValueError, TypeError) as e:
            raise InvalidRequestError(f"invalid {self.kind} constraint: {e}", param="response_format") from e


class GrammarCompiler:
    """Builds matchers for one tokenizer and vocabulary (the model's embedding rows)."""

    def __init__(self, tokenizer, vocab_size: int):
        import llguidance

        eos = tokenizer.eos_token_id
        # building the token trie takes ~0.2 s: once per process and tokenizer
        self.tokenizer = llguidance.LLTokenizer(tokenizer.backend_json(), n_vocab=vocab_size, eos_token=eos)
        self.vocab_size = vocab_size

    def check(self, structured: Structured) -> str:
        """The grammar for `structured`, validated; raises InvalidRequestError naming the problem."""
        from llguidance import LLMatcher

        structured.validate()
        grammar = structured.grammar()
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise InvalidRequestError(f"invalid {structured.kind} constraint: {messages[0]}", param="response_format")
        return grammar

    def llmatcher(self, structured: Structured):
        """A new llguidance matcher for `structured` (the engine wraps it in a GrammarState)."""
        from llguidance import LLMatcher, LLParserLimits

        # Earley items per mask step well below llguidance's 50,000: an ambiguous grammar errors
        # out sooner instead of taking ever longer per token (the engine also bounds its time)
        m = LLMatcher(self.tokenizer, self.check(structured), log_level=0,
                      limits=LLParserLimits(step_max_items=STEP_MAX_ITEMS))
        if m.is_error():
            raise InvalidRequestError(f"invalid {structured.kind} constraint: {m.get_error()}", param="response_format")
        return m
