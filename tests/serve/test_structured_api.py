"""Structured output, tools, /tokenize and /detokenize and per-request priority through the official openai
client. The tiny random model samples at temperature 1, so only the grammar makes its outputs valid."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from serve_helpers import live_server, openai_client, smol_tokenizer

MODEL = "tiny"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 3},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["utc", "cet"]}},
            "required": ["zone"],
        },
    },
}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def live():
    with live_server() as server:
        yield server


@pytest.fixture(scope="module")
def client(live):
    with openai_client(live.url, timeout=120) as c:
        yield c


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


def test_chat_json_schema_validates_streamed_and_not(client, live):
    kw = dict(
        model=MODEL, messages=USER, temperature=1.0, max_tokens=200, response_format=schema_format(PERSON)
    )
    full = client.chat.completions.create(**kw, n=8, seed=3)
    for choice in full.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    chunks = list(client.chat.completions.create(**kw, seed=3, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert streamed == full.choices[0].message.content  # same seed, same object
    live.wait_blocks_back()


def test_completions_structured_outputs(client):
    out = client.completions.create(
        model=MODEL, prompt="JSON:", max_tokens=200, temperature=1.0, seed=1, n=4,
        extra_body={"response_format": schema_format(PERSON)},
    )  # fmt: skip
    for c in out.choices:
        jsonschema.validate(json.loads(c.text), PERSON)
    out = client.completions.create(
        model=MODEL, prompt="Pick:", max_tokens=20, temperature=1.0, n=4,
        extra_body={"structured_outputs": {"choice": ["left", "right"]}},
    )  # fmt: skip
    assert {c.text for c in out.choices} <= {"left", "right"}
    out = client.completions.create(
        model=MODEL,
        prompt="Code:",
        max_tokens=20,
        temperature=1.0,
        extra_body={"guided_regex": "[A-Z]{2}[0-9]{3}"},
    )
    assert len(out.choices[0].text) == 5 and out.choices[0].text[:2].isupper()


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (
            {"response_format": schema_format({"type": "object", "patternProperties": {"^x": {}}})},
            "patternProperties",
        ),
        ({"guided_regex": "(?<=a)b"}, "Lookbehind"),
        ({"guided_grammar": 'root ::= "a" | nope'}, "nope"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex, guided_choice"),
        ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
    ],
)
def test_unsupported_constraint_is_a_400_naming_it(client, extra, named):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=5, extra_body=extra)
    assert named in e.value.message


def test_tool_choice_named_gives_a_valid_call(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    out = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        tools=[WEATHER, TIME],
        tool_choice=choice,
        temperature=1.0,
        max_tokens=200,
        n=4,
    )
    for c in out.choices:
        (call,) = c.message.tool_calls
        assert (
            c.finish_reason == "stop" and call.function.name == "get_weather" and call.id.startswith("call_")
        )
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_tool_choice_required_streams_valid_calls(client):
    kw = dict(model=MODEL, messages=USER, tools=[WEATHER, TIME], tool_choice="required", temperature=1.0)
    chunks = list(client.chat.completions.create(**kw, max_tokens=300, seed=5, stream=True))
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls and [tc.index for tc in calls] == list(range(len(calls)))
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for tc in calls:
        jsonschema.validate(json.loads(tc.function.arguments), schemas[tc.function.name])


def test_tool_results_are_accepted_in_the_conversation(client, live):
    messages = USER + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"},
    ]  # fmt: skip
    out = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], max_tokens=5, temperature=0
    )
    assert out.choices[0].message.tool_calls is None  # the random model answers in text: no invented call
    ids = httpx.post(f"{live.url}/tokenize", json={"messages": messages}).json()["tokens"]
    text = smol_tokenizer().decode(ids, skip_special_tokens=False)
    assert "21 degrees" in text and '"city": "Paris"' in text and "<tool_call>" in text


def test_bad_tool_choice_is_a_400(client):
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        choice = {"type": "function", "function": {"name": "nope"}}
        client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER], tool_choice=choice)
    with pytest.raises(openai.BadRequestError, match="tool_call_id"):
        client.chat.completions.create(model=MODEL, messages=USER + [{"role": "tool", "content": "x"}])


def test_tokenize_and_detokenize_round_trip(live):
    tok = smol_tokenizer()
    r = httpx.post(f"{live.url}/tokenize", json={"model": MODEL, "prompt": "Hello world"}).json()
    assert (
        r["tokens"] == tok.encode("Hello world")
        and r["count"] == len(r["tokens"])
        and r["max_model_len"] == 512
    )
    chat = httpx.post(f"{live.url}/tokenize", json={"messages": USER}).json()
    assert chat["tokens"] == tok.encode_chat(USER)
    back = httpx.post(f"{live.url}/detokenize", json={"tokens": r["tokens"]}).json()
    assert back["prompt"] == "Hello world"
    bad = httpx.post(f"{live.url}/detokenize", json={"tokens": [10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    both = httpx.post(f"{live.url}/tokenize", json={"prompt": "a", "messages": USER})
    assert both.status_code == 400 and "exactly one" in both.json()["error"]["message"]


def test_priority_and_deadline_reach_the_scheduler(client, live, monkeypatch):
    seen = {}
    add = live.engine.add_request

    def spy(*args, **kwargs):
        seen.update(priority=kwargs.get("priority"), deadline=kwargs.get("ttft_deadline"))
        return add(*args, **kwargs)

    monkeypatch.setattr(live.engine, "add_request", spy)
    client.completions.create(
        model=MODEL, prompt="x", max_tokens=1, extra_body={"priority": 7, "ttft_deadline_ms": 250}
    )
    assert seen["priority"] == 7 and seen["deadline"] is not None
    with pytest.raises(openai.BadRequestError, match="priority"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body={"priority": -1})
