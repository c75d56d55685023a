"""The SLO circuit breaker: unit transitions on a fake clock, then a live server shedding load under
injected failures and recovering through half-open probes."""

from __future__ import annotations

import time

import httpx
import pytest
from serve_helpers import live_server

from mcp2026.serve.config import ServeConfig
from mcp2026.serve.slo import CLOSED, HALF_OPEN, OPEN, BreakerConfig, BreakerOpen, CircuitBreaker
from mcp2026.serve.tenants import Tenant, TenantRegistry


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_probes_and_closes():
    clock, changes = Clock(), []
    config = BreakerConfig(window_s=60, num_buckets=6, threshold=0.2, min_requests=10, open_s=5, num_probes=2)
    breaker = CircuitBreaker(config, changes.append, clock)
    for i in range(10):
        breaker.admit(0)
        breaker.record(is_bad=i < 2)  # 20%: not above the threshold
    assert breaker.state == CLOSED
    breaker.record(is_bad=True)  # 3 of 11
    assert breaker.state == OPEN and breaker.num_trips == 1
    with pytest.raises(BreakerOpen) as e:
        breaker.admit(0)
    assert e.value.retry_after_s == pytest.approx(5)
    assert breaker.admit(-1) is False  # urgent tenants bypass
    clock.now = 5.0
    assert breaker.admit(0) is True and breaker.state == HALF_OPEN
    assert breaker.admit(0) is True
    with pytest.raises(BreakerOpen):
        breaker.admit(0)  # only num_probes at a time
    breaker.record(is_bad=True, is_probe=True)
    assert breaker.state == OPEN and breaker.num_trips == 2
    clock.now = 10.0
    for _ in range(2):
        assert breaker.admit(0)
        breaker.record(is_bad=False, is_probe=True)
    assert breaker.state == CLOSED and breaker.bad_share() == 0.0
    assert changes == [OPEN, HALF_OPEN, OPEN, HALF_OPEN, CLOSED]


def test_window_forgets_old_outcomes():
    clock = Clock()
    breaker = CircuitBreaker(BreakerConfig(window_s=10, num_buckets=5, min_requests=1), clock=clock)
    breaker.record(is_bad=False)
    clock.now = 11.0
    assert breaker.bad_share() == 0.0 and not breaker._buckets


MARKER = 777


def test_live_breaker_sheds_low_priority_and_recovers():
    config = ServeConfig(model_name="tiny", breaker=BreakerConfig(min_requests=3, open_s=0.5, num_probes=2))
    tenants = TenantRegistry({"low": Tenant("low", priority=0), "high": Tenant("high", priority=-1)})

    def fault(chunk):
        if MARKER in chunk.token_ids:
            raise RuntimeError("injected")

    with live_server(config, tenants=tenants) as live, httpx.Client(base_url=live.url, timeout=30) as client:
        live.engine.fault_hook = fault
        low, high = {"Authorization": "Bearer low"}, {"Authorization": "Bearer high"}
        bad = {"model": "tiny", "prompt": [MARKER, 5], "max_tokens": 2}
        good = {"model": "tiny", "prompt": [5, 6], "max_tokens": 2}
        assert [client.post("/v1/completions", json=bad, headers=low).status_code for _ in range(3)] == [
            500
        ] * 3
        r = client.post("/v1/completions", json=good, headers=low)
        assert r.status_code == 429 and r.json()["error"]["code"] == "breaker_open"
        assert int(r.headers["retry-after"]) >= 1
        assert client.post("/v1/completions", json=good, headers=high).status_code == 200
        metrics = client.get("/metrics").text
        assert 'mcp2026_breaker_state{model="tiny"} 2.0' in metrics
        time.sleep(0.6)
        assert [client.post("/v1/completions", json=good, headers=low).status_code for _ in range(3)] == [
            200
        ] * 3
        metrics = client.get("/metrics").text
        assert 'mcp2026_breaker_state{model="tiny"} 0.0' in metrics
        assert 'mcp2026_breaker_transitions_total{model="tiny",state="open"} 1.0' in metrics
        live.wait_blocks_back()
