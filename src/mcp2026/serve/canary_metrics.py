"""The live canary on /metrics: per-arm latency histograms and request counters, and gauges of the verdict,
each release metric's status and value, per-arm P99s and bandwidth utilisation, the candidate's current share,
the ramp's state and its shifts and verdicts so far (read at scrape time)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mcp2026.canary.gate import STATUS_VALUES, VERDICTS
from mcp2026.canary.ramp import SHIFT_DECISIONS, STATES
from mcp2026.canary.stats import p99

LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


def attach_canary_metrics(router: Any, registry: CollectorRegistry, model: str) -> None:
    """Register the canary's series on the server's registry (``router``: a ``serve.canary.CanaryRouter``,
    which imports this module); the arms feed their histograms."""
    ttft = Histogram(
        "mcp2026_canary_time_to_first_token_seconds",
        "Time to first token per canary arm",
        ["model", "arm"],
        registry=registry,
        buckets=LATENCY_BUCKETS_S,
    )
    e2e = Histogram(
        "mcp2026_canary_e2e_request_latency_seconds",
        "Arrival to last token per canary arm",
        ["model", "arm"],
        registry=registry,
        buckets=LATENCY_BUCKETS_S,
    )
    requests = Counter(
        "mcp2026_canary_requests",
        "Finished engine requests per canary arm",
        ["model", "arm"],
        registry=registry,
    )
    for arm in (router.baseline, router.candidate):
        arm.histograms = (
            ttft.labels(model, arm.name),
            e2e.labels(model, arm.name),
            requests.labels(model, arm.name),
        )
    registry.register(_CanaryCollector(router, model))


class _CanaryCollector(Collector):
    def __init__(self, router: Any, model: str) -> None:
        self.router = router
        self.model = model

    def collect(self) -> Iterable[Metric]:
        router, model = self.router, self.model
        router.tick()  # a scrape may be the first call after the evaluation interval
        result = router.verdict()
        verdict = GaugeMetricFamily(
            "mcp2026_canary_verdict", "1 for the live canary's current verdict", labels=["model", "verdict"]
        )
        for v in VERDICTS:
            verdict.add_metric([model, v], int(v == result.verdict))
        yield verdict
        status = GaugeMetricFamily(
            "mcp2026_canary_metric_status",
            "Per release metric: 0 safe, 1 hold, 2 trip",
            labels=["model", "metric"],
        )
        value = GaugeMetricFamily(
            "mcp2026_canary_metric_value",
            "Per release metric: its value (ms or %)",
            labels=["model", "metric"],
        )
        for d in result.decisions:
            status.add_metric([model, d.measurement.name], STATUS_VALUES[d.status])
            if d.measurement.value is not None:
                value.add_metric([model, d.measurement.name], d.measurement.value)
        yield status
        yield value
        p99s = GaugeMetricFamily(
            "mcp2026_canary_p99_seconds",
            "P99 latency per arm (latest window)",
            labels=["model", "arm", "latency"],
        )
        utilisation = GaugeMetricFamily(
            "mcp2026_canary_bandwidth_utilisation_ratio",
            "Estimated memory bandwidth utilisation of each arm's decode",
            labels=["model", "arm"],
        )
        for arm in (router.baseline, router.candidate):
            for latency, samples in (("ttft", arm.ttft_s), ("e2e", arm.e2e_s)):
                if samples:
                    p99s.add_metric([model, arm.name, latency], p99(samples))
            pct = arm.bandwidth(router.peak_bytes_per_s).utilisation_pct
            if pct is not None:
                utilisation.add_metric([model, arm.name], pct / 100)
        yield p99s
        yield utilisation
        yield from self._ramp_metrics()

    def _ramp_metrics(self) -> Iterable[Metric]:
        ramp, model = self.router.ramp, self.model
        share = GaugeMetricFamily(
            "mcp2026_canary_candidate_share",
            "Share of tenants routed to the candidate now (0 after a rollback, 1 once promoted)",
            labels=["model"],
        )
        share.add_metric([model], ramp.share)
        yield share
        state = GaugeMetricFamily(
            "mcp2026_canary_state",
            "1 for the ramp's state: observing (fixed share), ramping, promoted, rolled_back",
            labels=["model", "state"],
        )
        for s in STATES:
            state.add_metric([model, s], int(s == ramp.state))
        yield state
        shifts = CounterMetricFamily(
            "mcp2026_canary_shifts",
            "Changes of the candidate's share by decision",
            labels=["model", "decision"],
        )
        for decision in SHIFT_DECISIONS:
            shifts.add_metric([model, decision], ramp.num_shifts(decision))
        yield shifts
        evaluations = CounterMetricFamily(
            "mcp2026_canary_evaluations",
            "Verdicts the ramp acted on (HOLD keeps the share)",
            labels=["model", "verdict"],
        )
        for verdict in VERDICTS:
            evaluations.add_metric([model, verdict], ramp.num_evaluations[verdict])
        yield evaluations
