"""OpenTelemetry request spans, caught by the SDK's in-memory exporter: the request span and its queue /
prefill / decode / detokenize children, vLLM's attribute names, the client's traceparent as parent; and
no tracing at all unless asked."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest
from serve_helpers import live_server

from mcp2026.serve.config import ServeConfig

pytest.importorskip("opentelemetry.sdk.trace", reason="needs opentelemetry-sdk (the dev extra installs it)")
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from mcp2026.serve.tracing import Tracing, TracingMiddleware  # noqa: E402

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"
BODY = {"model": "tiny", "prompt": [9] * 20, "max_tokens": 8, "ignore_eos": True}


def finished_spans(exporter, num_spans):
    """The request span ends just after the response's last byte is sent, so wait for it."""
    deadline = time.monotonic() + 10
    while len(exporter.get_finished_spans()) < num_spans and time.monotonic() < deadline:
        time.sleep(0.01)
    return exporter.get_finished_spans()


@pytest.fixture(scope="module")
def traced():
    exporter = InMemorySpanExporter()
    with live_server(tracing=Tracing.with_exporter(exporter, batch=False)) as live:
        yield live, exporter


@pytest.mark.parametrize("stream", [False, True])
def test_request_span_with_phases_and_client_parent(traced, stream):
    live, exporter = traced
    exporter.clear()
    headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"}
    r = httpx.post(f"{live.url}/v1/completions", json={**BODY, "stream": stream}, headers=headers, timeout=30)
    assert r.status_code == 200
    spans = {s.name: s for s in finished_spans(exporter, 5)}
    assert set(spans) == {"POST /v1/completions", "queue", "prefill", "decode", "detokenize"}
    root = spans["POST /v1/completions"]
    assert f"{root.context.trace_id:032x}" == TRACE_ID
    assert f"{root.parent.span_id:016x}" == PARENT_SPAN_ID
    attrs = root.attributes
    assert attrs["gen_ai.response.model"] == "tiny"
    assert attrs["gen_ai.usage.prompt_tokens"] == 20
    assert attrs["gen_ai.usage.completion_tokens"] == 8
    assert attrs["http.response.status_code"] == 200
    assert 0 <= attrs["gen_ai.latency.time_in_queue"] <= attrs["gen_ai.latency.time_to_first_token"]
    assert attrs["gen_ai.latency.time_to_first_token"] <= attrs["gen_ai.latency.e2e"]
    assert tuple(attrs["gen_ai.response.finish_reasons"]) == ("length",)
    for name in ("queue", "prefill", "decode", "detokenize"):
        child = spans[name]
        assert child.parent.span_id == root.context.span_id
        assert child.context.trace_id == root.context.trace_id
        assert root.start_time <= child.start_time <= child.end_time <= root.end_time
    assert spans["queue"].end_time == spans["prefill"].start_time
    assert spans["prefill"].end_time == spans["decode"].start_time
    assert spans["detokenize"].end_time > spans["detokenize"].start_time  # 8 tokens took some time


def test_rejected_request_and_probes(traced):
    live, exporter = traced
    exporter.clear()
    assert httpx.get(f"{live.url}/healthz", timeout=5).status_code == 200
    assert exporter.get_finished_spans() == ()  # probes are not traced
    r = httpx.post(f"{live.url}/v1/completions", json={**BODY, "model": "other"}, timeout=30)
    assert r.status_code == 404
    (span,) = finished_spans(exporter, 1)  # a request the engine never saw: no phase spans
    assert span.attributes["http.response.status_code"] == 404


def test_off_by_default_installs_nothing():
    with live_server(ServeConfig(model_name="tiny")) as live:
        assert live.app.state.service.tracing is None
        assert not any(m.cls is TracingMiddleware for m in live.app.user_middleware)


def test_bad_endpoint_is_refused():
    with pytest.raises(ValueError, match="otlp_traces_endpoint must be an http"):
        ServeConfig(otlp_traces_endpoint="collector:4318")


def test_without_the_sdk_the_error_says_how_to_enable():
    # A child interpreter in which the SDK cannot be imported, as on an install without the otel extra.
    code = (
        "import sys; sys.modules['opentelemetry.sdk'] = None; sys.modules['opentelemetry.sdk.trace'] = None\n"
        "from mcp2026.serve.tracing import Tracing, TracingUnavailable\n"
        "try:\n    Tracing.from_endpoint('http://127.0.0.1:4318/v1/traces')\n"
        "except TracingUnavailable as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert "pip install 'mcp2026[otel]'" in out.stdout


def test_a_server_without_traces_never_imports_the_sdk():
    # The SDK's import is ~0.1 s of a start-up that must stay under 5 s; it is imported once traces are asked.
    # (FastAPI itself imports the small opentelemetry API package, not the SDK.)
    code = (
        "import sys\n"
        "import mcp2026.serve.server, mcp2026.serve.cli\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry.sdk')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]"


def test_otlp_exporter_follows_the_protocol_variable(monkeypatch):
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http", reason="needs the otel extra's exporter")
    from mcp2026.serve.tracing import TracingUnavailable, otlp_exporter

    exporter = otlp_exporter("http://127.0.0.1:4318/v1/traces")
    assert type(exporter).__module__.startswith("opentelemetry.exporter.otlp.proto.http")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    with pytest.raises(TracingUnavailable, match="not supported"):
        otlp_exporter("http://127.0.0.1:4318/v1/traces")
