"""Live server: weighted fair shares between two saturating tenants, and the pressure gate switching on a
real burst of long prompts (metrics show it)."""

from __future__ import annotations

import asyncio
import re
import threading
import time

import httpx
from serve_helpers import MODEL, live_server

from mcp2026.serve.config import ServeConfig
from mcp2026.serve.slo import BreakerConfig
from mcp2026.serve.tenants import Tenant, TenantRegistry
from mcp2026.serve.traffic import TrafficConfig

PROMPT_LEN, OUTPUT_LEN = 4, 8


async def _send(client: httpx.AsyncClient, url: str, key: str, i: int) -> int:
    body = {
        "model": MODEL,
        "prompt": [100 + (i * 7 + j) % 1000 for j in range(PROMPT_LEN)],
        "max_tokens": OUTPUT_LEN,
        "temperature": 0,
        "ignore_eos": True,
    }
    r = await client.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    return r.status_code


def test_two_tenants_share_tokens_by_weight():
    tenants = TenantRegistry(
        {"key-a": Tenant("a", weight=3, cache_salt="a"), "key-b": Tenant("b", cache_salt="b")}
    )
    # Every request is queued before the engine runs (both saturate from the first step), and "b" brings
    # more work than its share: it stays backlogged while "a" is measured.
    num_a, num_b = 72, 36
    work_a = num_a * (PROMPT_LEN + OUTPUT_LEN)
    # The breaker would shed requests whose TTFT grows with the queue: not what this test measures.
    config = ServeConfig(model_name=MODEL, breaker=BreakerConfig(enabled=False))
    with live_server(config, tenants, max_num_seqs=8) as live:
        samples: list[dict] = []
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                samples.append(dict(live.async_engine.stats.tenant_tokens))
                time.sleep(0.01)

        hold = threading.Event()
        live.async_engine.run_between_steps(lambda: hold.wait(30))  # the engine loop waits for the queue

        async def run() -> list[int]:
            limits = httpx.Limits(max_connections=num_a + num_b)  # all in flight at once
            async with httpx.AsyncClient(timeout=60, limits=limits) as client:
                jobs = [_send(client, live.url, "key-a", i) for i in range(num_a)]
                jobs += [_send(client, live.url, "key-b", num_a + i) for i in range(num_b)]
                tasks = [asyncio.ensure_future(job) for job in jobs]
                deadline = time.monotonic() + 30
                while live.async_engine.num_queued_requests < num_a + num_b and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                hold.set()
                return await asyncio.gather(*tasks)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            statuses = asyncio.run(run())
        finally:
            done.set()
            sampler.join(5)
        assert statuses == [200] * (num_a + num_b), sorted(set(statuses))
        live.wait_blocks_back()

    def at(fraction: float) -> dict:
        return next(s for s in samples if s.get("a", 0) >= fraction * work_a)

    start, end = at(0.1), at(0.75)
    a, b = end.get("a", 0) - start.get("a", 0), end.get("b", 0) - start.get("b", 0)
    assert 2.7 <= a / b <= 3.3, (a, b)


class Clock:
    def __init__(self) -> None:
        self.now = time.monotonic() + 1.0  # never behind what the profile has seen

    def __call__(self) -> float:
        return self.now


def test_pressure_gate_switches_on_a_burst_of_long_prompts():
    traffic = TrafficConfig(gate="observe", long_context_tokens=32, tick_s=0.1, min_requests=8, min_dwell_s=5)
    with live_server(ServeConfig(model_name=MODEL, traffic=traffic)) as live:
        clock = Clock()  # the profile's time: the test moves it, so the burst is a burst however slow the CPU
        live.app.state.service.traffic.clock = clock

        async def send(num: int, prompt_len: int) -> list[int]:
            body = {"model": MODEL, "prompt": [5] * prompt_len, "max_tokens": 1}
            async with httpx.AsyncClient(timeout=30) as client:
                jobs = [client.post(f"{live.url}/v1/completions", json=body) for _ in range(num)]
                return [r.status_code for r in await asyncio.gather(*jobs)]

        def wait_for(series: str) -> str:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                text = httpx.get(f"{live.url}/metrics").text
                if _value(text, series) >= 1:
                    return text
                time.sleep(0.05)
            raise AssertionError(f"{series} never counted a switch")

        assert asyncio.run(send(4, 8)) == [200] * 4  # calm: a few short prompts
        clock.now += 60
        assert asyncio.run(send(24, 64)) == [200] * 24  # a burst of long ones within one tick
        clock.now += 0.1  # the tick closes: the periodic update sees the burst
        text = wait_for('mcp2026_gate_switches_total{model="tiny",plan="pressure"}')
        assert _value(text, 'mcp2026_gate_plan{model="tiny",plan="pressure"}') == 1.0
        assert _value(text, 'mcp2026_traffic_burst_ratio{model="tiny"}') > 3
        clock.now += 120  # traffic stopped: the rate decays, pressure mode ends
        text = wait_for('mcp2026_gate_switches_total{model="tiny",plan="quality"}')
        assert _value(text, 'mcp2026_gate_plan{model="tiny",plan="quality"}') == 1.0
        assert "mcp2026_breaker_trips_total" in text


def _value(text: str, series: str) -> float:
    match = re.search(re.escape(series) + r" (\S+)", text)
    return float(match.group(1)) if match else 0.0
