"""Every error status with OpenAI's error body, request ids, CORS, tenants' keys and quotas (plain httpx)."""

from __future__ import annotations

import logging

import httpx
import pytest
from serve_helpers import MAX_MODEL_LEN, live_server

from mcp2026.serve.config import ServeConfig
from mcp2026.serve.tenants import Tenant, TenantRegistry

MODEL = "tiny"
OK_BODY = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}


@pytest.fixture(scope="module")
def live():
    with live_server() as server:
        yield server


def assert_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    assert r.headers["x-request-id"]
    return error


def test_bad_json_is_400(live):
    r = httpx.post(
        f"{live.url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert "JSON" in assert_error(r, 400)["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL, "prompt": "x", "max_tokens": "many"}, "max_tokens"),
        ({"model": MODEL, "prompt": "x", "temperature": 3}, "temperature"),
        ({"model": MODEL, "prompt": "x", "n": 0}, "n"),
        ({"model": MODEL}, "prompt"),
        ({"model": MODEL, "prompt": []}, "prompt"),
        ({"model": MODEL, "prompt": "x", "stop": [""]}, "stop"),
    ],
)
def test_bad_field_is_400(live, body, param):
    r = httpx.post(f"{live.url}/v1/completions", json=body)
    assert assert_error(r, 400)["param"].startswith(param)


def test_bad_chat_fields_are_400(live):
    url = f"{live.url}/v1/chat/completions"
    assert_error(httpx.post(url, json={"messages": []}), 400, param="messages")
    assert_error(httpx.post(url, json={"messages": [{"role": "wizard", "content": "x"}]}), 400)
    assert_error(
        httpx.post(url, json={"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}), 400
    )


def test_unknown_model_is_404(live):
    r = httpx.post(f"{live.url}/v1/completions", json={**OK_BODY, "model": "gpt-17"})
    assert_error(r, 404, param="model", code="model_not_found")


def test_unknown_route_and_method(live):
    assert_error(httpx.get(f"{live.url}/v1/nothing"), 404)
    assert_error(httpx.get(f"{live.url}/v1/completions"), 405)


def test_prompt_longer_than_context_is_400(live):
    r = httpx.post(f"{live.url}/v1/completions", json={"model": MODEL, "prompt": [5] * MAX_MODEL_LEN})
    error = assert_error(r, 400, param="prompt", code="context_length_exceeded")
    assert "context" in error["message"] and str(MAX_MODEL_LEN) in error["message"]
    r = httpx.post(f"{live.url}/v1/completions", json={"model": MODEL, "prompt": [10**6]})
    assert_error(r, 400, param="prompt")


def test_not_ready_is_503(live):
    service = live.app.state.service
    service.is_draining = True
    try:
        assert_error(httpx.post(f"{live.url}/v1/completions", json=OK_BODY), 503)
        assert_error(httpx.get(f"{live.url}/readyz"), 503)
        assert httpx.get(f"{live.url}/healthz").status_code == 200
    finally:
        service.is_draining = False
    assert httpx.get(f"{live.url}/readyz").status_code == 200


def test_request_id_echoed_generated_and_logged(live, caplog):
    caplog.set_level(logging.INFO, logger="mcp2026.serve")
    r = httpx.post(f"{live.url}/v1/completions", json=OK_BODY, headers={"X-Request-Id": "trace-abc.123"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-abc.123"
    assert any("trace-abc.123" in rec.getMessage() for rec in caplog.records)
    generated = httpx.get(f"{live.url}/healthz").headers["x-request-id"]
    assert len(generated) == 32
    unsafe = httpx.get(f"{live.url}/healthz", headers={"X-Request-Id": "bad id\twith spaces"})
    assert unsafe.headers["x-request-id"] != "bad id\twith spaces"
    assert_error(httpx.post(f"{live.url}/v1/completions", json={}), 400)  # errors carry it too


def test_metrics_exposition(live):
    httpx.post(f"{live.url}/v1/completions", json=OK_BODY)
    text = httpx.get(f"{live.url}/metrics").text
    for name in (
        "mcp2026_time_to_first_token_seconds_bucket",
        "mcp2026_e2e_request_latency_seconds_count",
        "mcp2026_request_queue_time_seconds_count",
        "mcp2026_time_per_output_token_seconds_count",
        "mcp2026_prompt_tokens_total",
        "mcp2026_generation_tokens_total",
        "mcp2026_requests_total",
        "mcp2026_num_requests_running",
        "mcp2026_num_requests_waiting",
        "mcp2026_kv_cache_usage_ratio",
        "mcp2026_num_preemptions_total",
        "mcp2026_prefix_cache_queries_total",
        "mcp2026_prefix_cache_hits_total",
    ):
        assert name in text, name
    assert 'mcp2026_requests_total{model="tiny",status="length",tenant="default"}' in text
    samples = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("mcp2026_engine_")
    }
    assert samples['mcp2026_engine_steps_total{model="tiny"}'] >= 2  # the request's prefill and decode steps
    for phase in ("prefill", "decode", "sample"):
        assert samples[f'mcp2026_engine_busy_seconds_total{{model="tiny",phase="{phase}"}}'] > 0
    for name in ("drafts", "draft_tokens", "accepted_tokens"):
        assert f'mcp2026_spec_decode_{name}_total{{model="tiny"}}' in text


TENANTS = TenantRegistry(
    {
        "key-a": Tenant("a", requests_per_minute=2, cache_salt="a"),
        "key-b": Tenant("b", weight=3, max_concurrency=4, cache_salt="b"),
    }
)


def test_keys_rate_limits_and_cors():
    config = ServeConfig(model_name=MODEL, cors_origins=("http://app.example",), max_queued_tokens=64)
    with live_server(config, tenants=TENANTS) as server:
        url = f"{server.url}/v1/completions"
        assert_error(httpx.post(url, json=OK_BODY), 401, code="invalid_api_key")
        assert_error(httpx.post(url, json=OK_BODY, headers={"Authorization": "Bearer nope"}), 401)
        assert_error(httpx.get(f"{server.url}/v1/models"), 401)
        a = {"Authorization": "Bearer key-a"}
        assert [httpx.post(url, json=OK_BODY, headers=a).status_code for _ in range(2)] == [200, 200]
        error = assert_error(r := httpx.post(url, json=OK_BODY, headers=a), 429, code="rate_limit_exceeded")
        assert "requests_per_minute" in error["message"] and int(r.headers["retry-after"]) >= 1
        b = {"Authorization": "Bearer key-b"}
        assert httpx.post(url, json=OK_BODY, headers=b).status_code == 200  # quotas are per tenant
        r = httpx.post(url, json={**OK_BODY, "prompt": [5] * 100}, headers=b)  # over max_queued_tokens
        assert_error(r, 429, code="queue_full")
        assert int(r.headers["retry-after"]) >= 1
        # CORS: the configured origin is allowed (preflight and simple), others are not.
        pre = httpx.options(
            url,
            headers={"Origin": "http://app.example", "Access-Control-Request-Method": "POST"},
        )
        assert pre.headers["access-control-allow-origin"] == "http://app.example"
        r = httpx.get(f"{server.url}/healthz", headers={"Origin": "http://evil.example"})
        assert "access-control-allow-origin" not in r.headers
        server.wait_blocks_back()


def test_no_cors_headers_by_default(live):
    r = httpx.get(f"{live.url}/healthz", headers={"Origin": "http://app.example"})
    assert "access-control-allow-origin" not in r.headers
