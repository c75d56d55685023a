"""Live traffic profile and the pressure-mode rule that drives the runtime gate (our design notes).

Profile ``<pct_long_ctx, qps_burst, err_rate_5m, avg_latency>``: the share of long-context prompts among
recent arrivals; the arrival rate as an EWMA of the observed Poisson rate per tick,
``lambda_t = 0.75 * lambda_{t-1} + 0.25 * arrivals / tick_s``, and its burst ratio against the long-run
rate; the error rate and mean latency of requests finished in the last 5 minutes.
Rule: pressure mode when ``long share > 0.6 and burst > 3.0 and error rate < 0.02``; back to quality when
any of them falls past its (looser) off threshold, never sooner than ``min_dwell_s`` after a switch.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

log = logging.getLogger("mcp2026.serve")

QUALITY, PRESSURE = "quality", "pressure"
GATES = ("auto", "quant", "kv", "observe", "off")


@dataclass(frozen=True)
class TrafficConfig:
    gate: str = "auto"  # auto: quant if the model has a QuantGate, else kv if KV eviction runs, else observe
    long_context_tokens: int = 2048  # prompts at least this long count as long-context
    tick_s: float = 1.0  # the EWMA's observation interval
    share_window_s: float = 60.0  # long-context share over arrivals in this window
    long_window_s: float = 600.0  # long-run arrival rate (the burst ratio's denominator)
    error_window_s: float = 300.0  # error rate and mean latency over requests finished in this window
    min_requests: int = 20  # fewer arrivals in the share window never switch pressure mode on
    long_share_on: float = 0.6
    burst_on: float = 3.0
    error_rate_on: float = 0.02  # pressure mode only while errors are rare
    long_share_off: float = 0.4
    burst_off: float = 1.5
    error_rate_off: float = 0.05
    min_dwell_s: float = 30.0  # no switch sooner than this after the last one
    pressure_kv_sparsity: float = 0.85  # kv gate: fraction of long contexts dropped under pressure

    def __post_init__(self) -> None:
        if self.gate not in GATES:
            raise ValueError(f"TrafficConfig.gate must be one of {GATES}, got {self.gate!r}")
        for name in ("tick_s", "share_window_s", "long_window_s", "error_window_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"TrafficConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.long_window_s < self.tick_s:
            raise ValueError("TrafficConfig.long_window_s must be >= tick_s")
        if not (self.long_share_off <= self.long_share_on and self.burst_off <= self.burst_on):
            raise ValueError("TrafficConfig: off thresholds must not exceed on thresholds (hysteresis)")
        if not self.error_rate_off >= self.error_rate_on:
            raise ValueError("TrafficConfig.error_rate_off must be >= error_rate_on (hysteresis)")
        if self.min_dwell_s < 0 or self.min_requests < 0 or self.long_context_tokens < 1:
            raise ValueError("TrafficConfig: min_dwell_s, min_requests >= 0 and long_context_tokens >= 1")
        if not 0 <= self.pressure_kv_sparsity < 1:
            raise ValueError(
                f"TrafficConfig.pressure_kv_sparsity must be in [0, 1), got {self.pressure_kv_sparsity}"
            )


@dataclass(frozen=True)
class TrafficSnapshot:
    long_share: float
    num_recent: int  # arrivals in the share window
    arrival_rate: float  # EWMA requests/s
    long_run_rate: float  # requests/s over the long window
    burst_ratio: float  # arrival_rate / long_run_rate (0 without traffic)
    error_rate: float
    mean_latency_s: float
    num_finished: int  # in the error window


class _Window:
    """Sums of per-bucket counters over the last ``span_s`` (buckets of ``width_s``)."""

    def __init__(self, span_s: float, width_s: float, num_fields: int) -> None:
        self.span_s, self.width_s = span_s, width_s
        self.buckets: deque[list[float]] = deque()  # [start, *fields]
        self.totals = [0.0] * num_fields

    def add(self, now: float, *values: float) -> None:
        self.expire(now)
        if not self.buckets or now - self.buckets[-1][0] >= self.width_s:
            self.buckets.append([now, *([0.0] * len(self.totals))])
        bucket = self.buckets[-1]
        for i, v in enumerate(values):
            bucket[i + 1] += v
            self.totals[i] += v

    def expire(self, now: float) -> list[float]:
        while self.buckets and now - self.buckets[0][0] > self.span_s:
            old = self.buckets.popleft()
            self.totals = [t - v for t, v in zip(self.totals, old[1:])]
        return self.totals


class TrafficProfile:
    """Thread-safe. ``observe_*`` take an optional ``now`` (the clock's seconds) so tests can replay time."""

    def __init__(
        self, config: TrafficConfig | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = c = config or TrafficConfig()
        self.clock = clock
        self._lock = threading.Lock()
        self._start: float | None = None
        self._rate = 0.0
        self._tick_start = 0.0
        self._tick_count = 0
        self._shares = _Window(c.share_window_s, c.share_window_s / 30, 2)  # arrivals, long arrivals
        self._arrivals = _Window(c.long_window_s, c.tick_s, 1)
        self._finished = _Window(c.error_window_s, c.error_window_s / 30, 3)  # finished, errors, latency sum

    def observe_arrival(self, num_prompt_tokens: int, now: float | None = None) -> None:
        now = self.clock() if now is None else now
        with self._lock:
            self._advance(now)
            self._tick_count += 1
            self._arrivals.add(now, 1)
            self._shares.add(now, 1, int(num_prompt_tokens >= self.config.long_context_tokens))

    def observe_finish(self, is_error: bool, latency_s: float | None, now: float | None = None) -> None:
        now = self.clock() if now is None else now
        with self._lock:
            self._advance(now)
            self._finished.add(now, 1, int(is_error), latency_s or 0.0)

    def snapshot(self, now: float | None = None) -> TrafficSnapshot:
        now = self.clock() if now is None else now
        with self._lock:
            self._advance(now)
            num_recent, num_long = self._shares.expire(now)
            (num_window,) = self._arrivals.expire(now)
            finished, errors, latency = self._finished.expire(now)
            elapsed = 0.0 if self._start is None else now - self._start
            long_run = num_window / min(self.config.long_window_s, max(elapsed, self.config.tick_s))
            return TrafficSnapshot(
                long_share=num_long / num_recent if num_recent else 0.0,
                num_recent=int(num_recent),
                arrival_rate=self._rate,
                long_run_rate=long_run,
                burst_ratio=self._rate / long_run if long_run > 0 else 0.0,
                error_rate=errors / finished if finished else 0.0,
                mean_latency_s=latency / finished if finished else 0.0,
                num_finished=int(finished),
            )

    def _advance(self, now: float) -> None:
        """Close every tick that ended before ``now``: one EWMA update each (idle ticks observe 0)."""
        if self._start is None:
            self._start = self._tick_start = now
            return
        tick = self.config.tick_s
        num_ticks = int((now - self._tick_start) // tick)
        if num_ticks <= 0:
            return
        self._rate = 0.75 * self._rate + 0.25 * self._tick_count / tick
        self._rate *= 0.75 ** min(num_ticks - 1, 10_000)
        self._tick_start += num_ticks * tick
        self._tick_count = 0


@runtime_checkable
class Gate(Protocol):
    """What the pressure rule switches: ``switch("quality" | "pressure")``, called between engine steps.
    ``mcp2026.quant.gate.QuantGate`` is one; ``KVPolicyGate`` and ``ObserveGate`` are the others."""

    def switch(self, to: str) -> Any: ...


class ObserveGate:
    """Switches nothing: pressure mode is only tracked, logged and counted (no gate configured)."""

    name = "observe"

    def __init__(self) -> None:
        self.current = QUALITY
        self.num_switches = 0

    def switch(self, to: str) -> bool:
        changed = to != self.current
        self.current, self.num_switches = to, self.num_switches + int(changed)
        return changed


class KVPolicyGate:
    """Switches the running KV eviction policy's budget: the configured one (quality) or one that drops
    ``pressure_sparsity`` of each long context (pressure). Call ``switch`` on the engine loop thread."""

    name = "kv"

    def __init__(self, evictor: Any, pressure_sparsity: float) -> None:
        self.evictor = evictor
        quality = evictor.budget
        sparsity = max(pressure_sparsity, quality.sparsity_ratio or 0.0)
        self.budgets = {
            QUALITY: quality,
            PRESSURE: dataclasses.replace(quality, sparsity_ratio=sparsity, max_kv_tokens=None),
        }
        self.current = QUALITY
        self.num_switches = 0

    def switch(self, to: str) -> bool:
        if to not in self.budgets:
            raise ValueError(f"plan must be one of {sorted(self.budgets)}, got {to!r}")
        if to == self.current:
            return False
        self.evictor.budget = self.evictor.policy.budget = self.budgets[to]
        self.current, self.num_switches = to, self.num_switches + 1
        return True


class PressureController:
    """Applies the rule to a profile and switches ``gate`` through ``run`` (e.g. the engine loop's
    ``run_between_steps``). ``on_switch(to, snapshot)`` is called for every switch (metrics)."""

    def __init__(
        self,
        profile: TrafficProfile,
        gate: Gate,
        run: Callable[[Callable[[], Any]], None] = lambda fn: fn(),
        on_switch: Callable[[str, TrafficSnapshot], None] | None = None,
    ) -> None:
        self.profile = profile
        self.config = profile.config
        self.gate = gate
        self.run = run
        self.on_switch = on_switch
        self.mode = QUALITY
        self.num_switches = 0
        self._last_switch: float | None = None
        self._lock = threading.Lock()

    def update(self, now: float | None = None) -> str | None:
        """Evaluate the rule now; returns the new mode if it switched."""
        now = self.profile.clock() if now is None else now
        snap = self.profile.snapshot(now)
        with self._lock:
            if self._last_switch is not None and now - self._last_switch < self.config.min_dwell_s:
                return None
            to = self._decide(snap)
            if to is None:
                return None
            self.mode, self._last_switch = to, now
            self.num_switches += 1
        log.warning(
            "traffic: %s mode (long share %.2f, burst %.1fx at %.1f req/s, error rate %.3f, mean latency %.0f ms)",
            to,
            snap.long_share,
            snap.burst_ratio,
            snap.arrival_rate,
            snap.error_rate,
            snap.mean_latency_s * 1e3,
        )
        self.run(lambda: self.gate.switch(to))
        if self.on_switch is not None:
            self.on_switch(to, snap)
        return to

    def _decide(self, s: TrafficSnapshot) -> str | None:
        c = self.config
        if self.mode == QUALITY:
            is_on = (
                s.num_recent >= c.min_requests
                and s.long_share > c.long_share_on
                and s.burst_ratio > c.burst_on
                and s.error_rate < c.error_rate_on
            )
            return PRESSURE if is_on else None
        is_off = (
            s.long_share < c.long_share_off or s.burst_ratio < c.burst_off or s.error_rate > c.error_rate_off
        )
        return QUALITY if is_off else None
