"""Structured output on the real model: every constrained output parses and validates (JSON
schemas with nested objects, arrays, enums, bounded numbers, required fields; any JSON object;
regex; choice), also batched with unconstrained requests (which stay exactly as they are
alone); invalid constraints are named errors."""
import json
import re

import jsonschema
import pytest

from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.core.engine import LLMEngine
from pdserve.common.errors import InvalidRequestError
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.structured import Structured

pytestmark = pytest.mark.slow

SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "maxLength": 40}},
        "required": ["name", "age"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "location": {"type": "object", "properties": {
            "lat": {"type": "number", "minimum": -90, "maximum": 90},
            "lon": {"type": "number", "minimum": -180, "maximum": 180}},
            "required": ["lat", "lon"], "additionalProperties": False}},
        "required": ["city", "location"], "additionalProperties": False},
    "array_enum": {"type": "object", "properties": {
        "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
        "mood": {"enum": ["happy", "sad"]}},
        "required": ["colors", "mood"], "additionalProperties": False},
    "list_of_objects": {"type": "object", "properties": {
        "items": {"type": "array", "maxItems": 2, "items": {"type": "object", "properties": {
            "sku": {"type": "string", "maxLength": 10}, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["sku", "qty"], "additionalProperties": False}}},
        "required": ["items"], "additionalProperties": False},
}
PROMPT = "Answer in JSON. Describe something about Paris."


@pytest.fixture(scope="module")
def engine(smollm):
    loaded, tok = smollm
    eng = LLMEngine(loaded, EngineConfig(cache=CacheConfig(kv_cache_memory=64 << 20)), tok)
    yield eng
    assert eng.blocks.num_used_blocks == 0 and not eng.has_unfinished_requests()


def chat(tok, text: str) -> list[int]:
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


def schema_params(name: str, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=200, structured=Structured("json_schema", json.dumps(SCHEMAS[name])), **kw)


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, seed=3)], ids=["greedy", "seeded"])
def test_json_schemas_always_validate(engine, smollm, sampling):
    tok = smollm[1]
    names = list(SCHEMAS)
    outs = engine.generate([chat(tok, PROMPT)] * len(names), [schema_params(n, **sampling) for n in names])
    for name, out in zip(names, outs):
        doc = json.loads(tok.decode(out, skip_special_tokens=True))
        jsonschema.validate(doc, SCHEMAS[name])


def test_batched_with_unconstrained_requests(engine, smollm):
    tok = smollm[1]
    free = [chat(tok, "Write a haiku about the sea."), chat(tok, "Count to five.")]
    free_params = SamplingParams(max_tokens=24, temperature=0)
    alone = engine.generate(free, free_params)
    prompts = [free[0], chat(tok, PROMPT), free[1], chat(tok, "Describe a cat as JSON with keys name and age.")]
    params = [free_params, schema_params("person", temperature=0), free_params,
              SamplingParams(max_tokens=120, temperature=0, structured=Structured("json_object"))]
    outs = engine.generate(prompts, params)
    assert [outs[0], outs[2]] == alone  # masks of other rows never leak into these
    jsonschema.validate(json.loads(tok.decode(outs[1], skip_special_tokens=True)), SCHEMAS["person"])
    assert isinstance(json.loads(tok.decode(outs[3], skip_special_tokens=True)), dict)


def test_regex_and_choice(engine, smollm):
    tok = smollm[1]
    pattern = r"[0-9]{3}-[0-9]{4}"
    outs = engine.generate([chat(tok, "Give me a phone number."), chat(tok, "Is the sky blue?")], [
        SamplingParams(max_tokens=20, temperature=0.8, seed=1, structured=Structured("regex", pattern)),
        SamplingParams(max_tokens=20, temperature=0, structured=Structured("choice", json.dumps(["yes", "no"])))])
    assert re.fullmatch(pattern, tok.decode(outs[0], skip_special_tokens=True))
    assert tok.decode(outs[1], skip_special_tokens=True) in ("yes", "no")


@pytest.mark.parametrize("structured, needle", [
    (Structured("json_schema", '{"type": "frobnicate"}'), "json_schema"),
    (Structured("json_schema", "{not json"), "json_schema"),
    (Structured("regex", "([a-z]"), "regex"),
    (Structured("choice", "[]"), "choice"),
    (Structured("yaml", "x"), "kind"),
])
def test_invalid_constraints_are_named_errors(engine, structured, needle):
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("bad", [1, 2, 3], SamplingParams(max_tokens=4, structured=structured))
    assert e.value.param == "response_format" and needle in str(e.value)
    assert not engine.has_unfinished_requests()


def test_schemas_as_users_write_them_are_compiled_strictly():
    """Unlisted properties are not generated unless the schema allows them: nested objects,
    definitions and alternatives included; explicit permissions stay as written."""
    from pdserve.common.structured import strict_schema

    loose = {"type": "object", "properties": {
        "city": {"type": "string"},
        "where": {"type": "object", "properties": {"lat": {"type": "number"}}},
        "tags": {"type": "array", "items": {"type": "object", "properties": {"t": {"type": "string"}}}},
        "any": {"type": "object", "properties": {"k": {}}, "additionalProperties": True},
        "alt": {"anyOf": [{"$ref": "#/$defs/point"}, {"type": "null"}]},
        "properties": {"type": "object", "properties": {"x": {"type": "string"}}}},  # a property named so
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}}}}}
    s = strict_schema(loose)
    assert s["additionalProperties"] is False
    p = s["properties"]
    assert p["where"]["additionalProperties"] is False and p["tags"]["items"]["additionalProperties"] is False
    assert p["any"]["additionalProperties"] is True  # allowed explicitly: kept
    assert s["$defs"]["point"]["additionalProperties"] is False and p["alt"]["anyOf"][1] == {"type": "null"}
    assert p["properties"]["additionalProperties"] is False and "additionalProperties" not in p  # not the map
    assert loose["properties"]["where"] == {"type": "object", "properties": {"lat": {"type": "number"}}}  # untouched


def test_a_schema_without_additional_properties_false_still_ends(engine, smollm):
    """The schema as users write it (no `additionalProperties`): the object closes after
    its properties instead of growing until max_tokens."""
    tok = smollm[1]
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["city", "days"]}
    params = SamplingParams(max_tokens=120, temperature=0, structured=Structured("json_schema", json.dumps(schema)))
    out = engine.generate([chat(tok, "Plan a trip. Answer in JSON with a city and a number of days.")], params)[0]
    doc = json.loads(tok.decode(out, skip_special_tokens=True))
    assert set(doc) == {"city", "days"} and len(out) < 120


def test_a_numbers_digits_are_bounded_as_a_doubles_are(smollm):
    """A number or integer without bounds of its own takes at most 16 digits before the point
    and 10 after it (a small model sampled at temperature 1 wrote a latitude's fraction on for
    190 digits, until max_tokens); bounds and steps a schema gives stay its own."""
    from pdserve.common.structured import SAFE_INTEGER, GrammarCompiler, strict_schema

    loaded, tok = smollm
    compiler = GrammarCompiler(tok, loaded.config.vocab_size)

    def takes(schema: dict, text: str) -> bool:
        m = compiler.llmatcher(Structured("json_schema", json.dumps(schema)))
        return bool(m.consume_tokens(tok.encode(text, add_special_tokens=False))) and m.is_accepting()

    lat = {"type": "number", "minimum": -90, "maximum": 90}
    assert takes(lat, "27.9885091234") and not takes(lat, "27.98850912345") and not takes(lat, "91")
    assert takes({"type": "integer"}, str(SAFE_INTEGER)) and not takes({"type": "integer"}, str(SAFE_INTEGER + 1))
    assert takes({"type": "number"}, "-12.5") and not takes({"type": "number"}, "1" * 17)
    assert takes({"type": ["number", "null"]}, "null") and not takes({"type": ["number", "null"]}, "0." + "1" * 11)
    own = {"type": "number", "exclusiveMinimum": 0, "maximum": 1000, "multipleOf": 0.5}
    assert strict_schema(own) == own and takes(own, "999.5") and not takes(own, "999.25") and not takes(own, "0")
