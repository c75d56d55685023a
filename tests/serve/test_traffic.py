"""Traffic profile (EWMA arrival rate, burst ratio, long share, error rate) and the pressure-mode rule,
replayed on synthetic timestamps: no real waiting."""

from __future__ import annotations

import random

import pytest

from mcp2026.serve.traffic import (
    PRESSURE,
    QUALITY,
    KVPolicyGate,
    ObserveGate,
    PressureController,
    TrafficConfig,
    TrafficProfile,
)

LONG, SHORT = 4096, 200


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def replay(
    controller: PressureController,
    clock: Clock,
    start: float,
    seconds: float,
    rate: float,
    long_share: float,
    rng: random.Random,
    error_share: float = 0.0,
) -> list[tuple[float, str]]:
    """Poisson arrivals at ``rate`` for ``seconds``; each request finishes 0.5 s later. Returns switches."""
    switches = []
    t, end = start, start + seconds
    while True:
        t += rng.expovariate(rate)
        if t >= end:
            break
        clock.now = t
        tokens = LONG if rng.random() < long_share else SHORT
        controller.profile.observe_arrival(tokens)
        controller.profile.observe_finish(rng.random() < error_share, 0.5, now=t)
        to = controller.update()
        if to is not None:
            switches.append((t, to))
    clock.now = end
    return switches


def test_ewma_follows_the_design_formula():
    profile = TrafficProfile(TrafficConfig(tick_s=1.0), clock=Clock())
    for _ in range(4):
        profile.observe_arrival(10, now=0.0)  # tick [0, 1): 4 arrivals
    profile.observe_arrival(10, now=1.5)  # closes tick 0: 0.25 * 4
    assert profile.snapshot(now=1.5).arrival_rate == pytest.approx(1.0)
    snap = profile.snapshot(now=3.0)  # closes [1, 2) with 1 arrival and [2, 3) with none
    assert snap.arrival_rate == pytest.approx((0.75 * 1.0 + 0.25 * 1.0) * 0.75)
    assert snap.long_share == 0.0 and snap.num_recent == 5


def test_long_share_error_rate_and_latency_windows():
    profile = TrafficProfile(TrafficConfig(long_context_tokens=100, error_window_s=300, share_window_s=60))
    for i in range(10):
        profile.observe_arrival(500 if i < 7 else 50, now=float(i))
        profile.observe_finish(i == 0, 0.1 * (i + 1), now=float(i))
    snap = profile.snapshot(now=10.0)
    assert snap.long_share == pytest.approx(0.7)
    assert snap.error_rate == pytest.approx(0.1)
    assert snap.mean_latency_s == pytest.approx(0.55)
    later = profile.snapshot(now=400.0)  # everything expired
    assert later.num_recent == 0 and later.num_finished == 0 and later.error_rate == 0.0


def test_gate_switches_under_bursty_long_load_and_back():
    clock = Clock()
    profile = TrafficProfile(TrafficConfig(), clock=clock)
    gate = ObserveGate()
    seen = []
    controller = PressureController(profile, gate, on_switch=lambda to, snap: seen.append((to, snap)))
    rng = random.Random(0)
    # Ten calm minutes, mostly short prompts: never pressure.
    assert replay(controller, clock, 0, 600, rate=1.0, long_share=0.2, rng=rng) == []
    # A burst of long contexts: 10x the rate.
    on = replay(controller, clock, 600, 30, rate=10.0, long_share=0.9, rng=rng)
    assert [to for _, to in on] == [PRESSURE] and on[0][0] < 615
    assert gate.current == PRESSURE and seen[0][1].burst_ratio > 3 and seen[0][1].long_share > 0.6
    # It subsides: back to quality (after the dwell), once.
    off = replay(controller, clock, 630, 300, rate=1.0, long_share=0.2, rng=rng)
    assert [to for _, to in off] == [QUALITY]
    assert off[0][0] - on[0][0] >= controller.config.min_dwell_s
    assert gate.current == QUALITY and gate.num_switches == controller.num_switches == 2


def test_no_switch_when_errors_are_high_or_load_is_steady():
    clock = Clock()
    controller = PressureController(TrafficProfile(TrafficConfig(), clock=clock), ObserveGate())
    rng = random.Random(1)
    replay(controller, clock, 0, 600, rate=1.0, long_share=0.2, rng=rng, error_share=0.05)
    # A burst of long contexts while 5% of requests fail: the rule keeps quality.
    assert replay(controller, clock, 600, 30, rate=10.0, long_share=0.9, rng=rng, error_share=0.05) == []
    # Steady long-context traffic at the usual rate is no burst either.
    steady = PressureController(TrafficProfile(TrafficConfig(), clock=clock), ObserveGate())
    assert replay(steady, clock, 0, 900, rate=2.0, long_share=0.9, rng=rng) == []


def test_hysteresis_holds_pressure_between_the_thresholds():
    clock = Clock()
    controller = PressureController(TrafficProfile(TrafficConfig(min_dwell_s=0), clock=clock), ObserveGate())
    rng = random.Random(2)
    replay(controller, clock, 0, 600, rate=1.0, long_share=0.2, rng=rng)
    replay(controller, clock, 600, 30, rate=10.0, long_share=0.9, rng=rng)
    assert controller.mode == PRESSURE
    # Long share 0.5 is below "on" (0.6) but above "off" (0.4), rate still bursty: stays in pressure.
    assert replay(controller, clock, 630, 10, rate=10.0, long_share=0.5, rng=rng) == []


def test_kv_policy_gate_switches_the_eviction_budget():
    from mcp2026.kv.compressor import KVCompressor
    from mcp2026.kv.manager import KVCacheManager

    compressor = KVCompressor(dtype="int8", policy="sink_window", sparsity_ratio=0.3)
    evictor = compressor.make_evictor(KVCacheManager(16, 64), 1024)
    gate = KVPolicyGate(evictor, pressure_sparsity=0.85)
    assert gate.switch(PRESSURE) and evictor.budget.sparsity_ratio == 0.85
    assert evictor.policy.budget is evictor.budget
    assert not gate.switch(PRESSURE)
    assert gate.switch(QUALITY) and evictor.budget.sparsity_ratio == 0.3 and gate.num_switches == 2
    with pytest.raises(ValueError, match="plan"):
        gate.switch("fast")
