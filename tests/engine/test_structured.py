"""Structured output: every generated object parses and validates, whatever the (random) model prefers.

A tiny random model over the real SmolLM2 vocabulary samples at temperature 1, so the grammar mask alone keeps
the outputs valid: without it almost no sample would even parse.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from mcp2026.config import EngineConfig, KVConfig, SchedulerConfig
from mcp2026.engine.engine import LLMEngine
from mcp2026.engine.structured import GrammarError, allocate_bitmask, check_schema, unpack_bitmask
from mcp2026.types import SamplingParams, StructuredOutputs
from serve.serve_helpers import smol_tokenizer, tiny_vocab_model

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 8},
                    "zip": {"type": "string", "pattern": "[0-9]{5}"},
                },
                "required": ["city", "zip"],
            },
        },
        "required": ["name", "address"],
    },
    "enums_and_integers": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "integer", "minimum": 1, "maximum": 99},
            "ok": {"type": "boolean"},
        },
        "required": ["color", "size", "ok"],
    },
    "arrays_and_refs": {
        "type": "object",
        "$defs": {"tag": {"type": "string", "enum": ["a", "b", "c"]}},
        "properties": {
            "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "minItems": 1, "maxItems": 4},
            "point": {
                "type": "array",
                "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 9}] * 2,
                "minItems": 2,
                "maxItems": 2,
            },  # fmt: skip
            "note": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 6}]},
        },
        "required": ["tags", "point", "note"],
    },
}


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    model = tiny_vocab_model()
    config = EngineConfig(KVConfig(block_size=16, num_blocks=512), SchedulerConfig(max_num_seqs=64))
    return LLMEngine(model.model, model.config, smol_tokenizer(), config)


def structured(seed: int, max_tokens: int = 200, **spec) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, temperature=1.0, seed=seed, structured_outputs=StructuredOutputs(**spec)
    )


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_sampled_objects_always_validate(engine: LLMEngine, name: str) -> None:
    schema = SCHEMAS[name]
    params = [structured(seed, json=json.dumps(schema)) for seed in range(34)]
    outputs = engine.generate(["Give me JSON:"] * len(params), params)
    for out in outputs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)
    assert len({o.text for o in outputs}) > 5  # really sampled, not one forced answer


def test_without_the_grammar_the_same_model_does_not_produce_json(engine: LLMEngine) -> None:
    outputs = engine.generate(
        ["Give me JSON:"] * 4, [SamplingParams(max_tokens=30, temperature=1.0, seed=s) for s in range(4)]
    )
    for out in outputs:
        with pytest.raises(ValueError):
            json.loads(out.text)


def test_regex_choice_and_grammar(engine: LLMEngine) -> None:
    cases = [
        (dict(regex=r"[a-z]{3}-[0-9]{2}"), lambda t: re.fullmatch(r"[a-z]{3}-[0-9]{2}", t)),
        (dict(choice=("yes", "no", "maybe")), lambda t: t in ("yes", "no", "maybe")),
        (dict(grammar='root ::= "(" [0-9] ("+" [0-9])* ")"'), lambda t: re.fullmatch(r"\(\d(\+\d)*\)", t)),
    ]
    for spec, ok in cases:
        outputs = engine.generate(["x"] * 6, [structured(s, max_tokens=300, **spec) for s in range(6)])
        for out in outputs:
            assert out.finish_reason == "stop" and ok(out.text), (spec, out.text)


def test_greedy_and_logprobs_rows_are_masked_too(engine: LLMEngine) -> None:
    params = SamplingParams(
        max_tokens=50, logprobs=2, structured_outputs=StructuredOutputs(choice=("alpha", "beta"))
    )
    out = engine.generate(["x"], [params])[0]
    assert out.text in ("alpha", "beta")
    assert all(lp.logprob > float("-inf") for lp in out.logprobs)


@pytest.mark.parametrize(
    ("schema", "named"),
    [
        ({"type": "object", "patternProperties": {"^a": {}}}, "'patternProperties' at #"),
        (
            {"type": "object", "properties": {"x": {"type": "string", "format": "email"}}},
            "'format' at #/properties/x",
        ),
        ({"oneOf": [{"type": "string"}]}, "'oneOf'"),
        ({"type": "number", "minimum": 0.5}, "'minimum' on a number"),
    ],
)
def test_unenforceable_schema_is_refused_naming_the_construct(
    engine: LLMEngine, schema: dict, named: str
) -> None:
    with pytest.raises(GrammarError, match=re.escape(named)):
        engine.add_request("x", structured(0, json=json.dumps(schema)))
    assert not engine.has_unfinished()


def test_bad_regex_and_grammar_are_refused(engine: LLMEngine) -> None:
    with pytest.raises(GrammarError, match="Lookbehind"):
        engine.add_request("x", structured(0, regex="(?<=a)b"))
    with pytest.raises(GrammarError, match="not defined"):
        engine.add_request("x", structured(0, grammar='root ::= "a" | foo'))


def test_schema_depth_is_bounded() -> None:
    deep: dict = {"type": "string"}
    for _ in range(40):
        deep = {"type": "array", "items": deep}
    with pytest.raises(GrammarError, match="deeper than"):
        check_schema(deep)


def test_structured_outputs_exclude_ignore_eos_and_min_tokens() -> None:
    spec = StructuredOutputs(json_object=True)
    with pytest.raises(ValueError, match="ignore_eos or min_tokens"):
        SamplingParams(structured_outputs=spec, ignore_eos=True)
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs(json_object=True, regex="a")


def test_unpack_bitmask_bit_order() -> None:
    packed = torch.tensor([[0b101, -(1 << 31), 1 << 8], [0, 0, 1]], dtype=torch.int32)  # tokens 0, 2, 63, 72
    mask = unpack_bitmask(packed, 80)
    assert mask.shape == (2, 80)
    assert mask[0].nonzero().flatten().tolist() == [0, 2, 63, 72]
    assert mask[1].nonzero().flatten().tolist() == [64]


def test_matcher_follows_outputs_taken_back(engine: LLMEngine) -> None:
    vocab = engine.model_config.vocab_size
    matcher = engine.grammar_compiler().matcher(
        StructuredOutputs(choice=("abc", "xyz")), engine.eos_token_ids
    )
    bitmask = allocate_bitmask(1, vocab)

    def allowed(outputs: list[int]) -> set[int]:
        matcher.fill_mask(outputs, bitmask, 0)
        return set(unpack_bitmask(bitmask, vocab)[0].nonzero().flatten().tolist())

    first = allowed([])
    (x,) = smol_tokenizer().encode("x", add_special_tokens=False)
    assert x in first
    assert x not in allowed([x])
    assert allowed([]) == first  # taken back to the start
