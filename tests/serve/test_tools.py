"""Tool-call parsing and the constraints for required and named calls (no model needed)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from mcp2026.serve.protocol import ChatCompletionRequest
from mcp2026.serve.tools import constraint, parse_tool_calls, plan_tools, template_inputs

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
USER = [{"role": "user", "content": "hi"}]


def plan(tool_choice=None, parallel=True):
    req = ChatCompletionRequest(
        messages=USER, tools=[WEATHER], tool_choice=tool_choice, parallel_tool_calls=parallel
    )
    return plan_tools(req)


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    ],
)
def test_auto_parses_hermes_mistral_and_llama3(text):
    content, calls = parse_tool_calls(plan(), text)
    assert content is None
    (call,) = calls
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {
        "city": "Paris"
    }
    assert call["type"] == "function" and call["id"].startswith("call_")


def test_auto_keeps_text_and_unknown_tools_as_content():
    p = plan()
    assert parse_tool_calls(p, "Sunny today.") == ("Sunny today.", [])
    unknown = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    assert parse_tool_calls(p, unknown) == (unknown, [])
    broken = '<tool_call>{"name": "get_weather", "arguments": </tool_call>'
    assert parse_tool_calls(p, broken) == (broken, [])
    content, calls = parse_tool_calls(
        p, 'Let me check.<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    )
    assert content == "Let me check." and len(calls) == 1


def test_parallel_tool_calls_false_keeps_one_call():
    two = '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>' * 2
    assert len(parse_tool_calls(plan(), two)[1]) == 2
    assert len(parse_tool_calls(plan(parallel=False), two)[1]) == 1


def test_required_and_named_constraints():
    required = json.loads(constraint(plan("required")).json)
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "x"}}], required)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], required)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "other", "parameters": {}}], required)
    named = plan({"type": "function", "function": {"name": "get_weather"}})
    assert json.loads(constraint(named).json) == WEATHER["function"]["parameters"]
    assert parse_tool_calls(named, '{"city": "Oslo"}')[1][0]["function"]["name"] == "get_weather"
    assert constraint(plan("auto")) is None and plan("none") is None


def test_tools_become_a_system_message_for_templates_without_tools():
    messages, tools = template_inputs(plan(), [{"role": "user", "content": "hi"}], "{{ messages }}")
    assert tools is None and messages[0]["role"] == "system" and "get_weather" in messages[0]["content"]
    messages, tools = template_inputs(
        plan(), [{"role": "user", "content": "hi"}], "{% if tools %}{% endif %}"
    )
    assert tools == [WEATHER] and messages == [{"role": "user", "content": "hi"}]
