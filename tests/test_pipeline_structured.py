"""Structured output and priorities through ``Pipeline.infer`` on the real default model (SmolLM2-135M)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from mcp2026 import Pipeline, SamplingParams, SchedulerConfig, StructuredOutputs

pytestmark = pytest.mark.slow

CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "country": {"type": "string", "maxLength": 20},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 50},
        "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 3},
    },
    "required": ["city", "country", "population_millions", "landmarks"],
}
ASK = [{"role": "user", "content": "Describe Paris as a JSON object."}]


@pytest.fixture(scope="module")
def pipe() -> Pipeline:
    return Pipeline(scheduler=SchedulerConfig(policy="priority"))


def test_json_schema_and_json_object_on_the_real_model(pipe: Pipeline) -> None:
    schema = SamplingParams(max_tokens=120, temperature=0.8, structured_outputs=StructuredOutputs(json=CITY))
    anything = SamplingParams(
        max_tokens=160, temperature=0.3, structured_outputs=StructuredOutputs(json_object=True)
    )
    params = [SamplingParams(**{**vars(p), "seed": s}) for p in (schema, anything) for s in range(6)]
    result = pipe.infer([ASK] * len(params), params)
    for out in result.outputs[:6]:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), CITY)
    # Any object: a 135M model may ramble past max_tokens (a valid prefix, "length"); whatever ends parses.
    finished = [out for out in result.outputs[6:] if out.finish_reason == "stop"]
    assert finished and all(isinstance(json.loads(out.text), dict) for out in finished)


def test_priority_and_deadline_reach_the_scheduler(pipe: Pipeline, monkeypatch: pytest.MonkeyPatch) -> None:
    queued = []
    add = pipe.engine.scheduler.add_request
    monkeypatch.setattr(pipe.engine.scheduler, "add_request", lambda r: (queued.append(r), add(r))[1])
    greedy = SamplingParams(max_tokens=4)
    result = pipe.infer(["a", "b"], greedy, priority=[5, 0], ttft_deadline_ms=500)
    assert [o.finish_reason for o in result.outputs] == ["length", "length"]
    assert [r.priority for r in queued] == [5, 0]
    assert all(r.ttft_deadline is not None and 0.4 < r.ttft_deadline - r.arrival_time < 0.6 for r in queued)
    with pytest.raises(ValueError, match="priorities"):
        pipe.infer(["a", "b"], greedy, priority=[1])
