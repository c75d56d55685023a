"""Prometheus metrics of one server (its own CollectorRegistry). Names start with ``mcp2026_``; per-request
series carry ``tenant`` and ``model`` labels, engine-wide ones ``model``. deploy/grafana/mcp2026.json
charts these names: rename one there too.

Engine-wide values (running/waiting requests, KV usage, preemptions, prefix-cache lookups) are read from
the engine's latest stats at scrape time, so the engine loop never waits on the metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mcp2026.engine.engine import StepStats
from mcp2026.engine.scheduler import SchedulerStats
from mcp2026.serve.traffic import PRESSURE, QUALITY, TrafficSnapshot

LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)
LABELS = ("tenant", "model")


class _EngineCollector(Collector):
    def __init__(self, model: str, read_stats: Callable[[], SchedulerStats]) -> None:
        self.model = model
        self.read_stats = read_stats

    def collect(self) -> Iterable[Metric]:
        stats = self.read_stats()
        gauges = [
            ("mcp2026_num_requests_running", "Requests in the running batch", stats.num_running),
            ("mcp2026_num_requests_waiting", "Requests waiting for admission", stats.num_waiting),
            ("mcp2026_kv_cache_usage_ratio", "Fraction of KV blocks in use", stats.kv_usage),
        ]
        for name, doc, value in gauges:
            metric = GaugeMetricFamily(name, doc, labels=["model"])
            metric.add_metric([self.model], value)
            yield metric
        counters = [
            (
                "mcp2026_num_preemptions",
                "Requests preempted (blocks freed, recomputed)",
                stats.num_preemptions,
            ),
            (
                "mcp2026_prefix_cache_queries",
                "Full KV blocks looked up in the prefix cache",
                stats.num_prefix_query_blocks,
            ),
            (
                "mcp2026_prefix_cache_hits",
                "Full KV blocks found in the prefix cache",
                stats.num_prefix_hit_blocks,
            ),
        ]
        for name, doc, value in counters:
            metric = CounterMetricFamily(name, doc, labels=["model"])
            metric.add_metric([self.model], value)
            yield metric
        tokens = CounterMetricFamily(
            "mcp2026_tenant_processed_tokens",
            "Tokens computed per tenant (prefill + decode): what weighted fair scheduling shares",
            labels=["tenant", "model"],
        )
        for tenant, value in stats.tenant_tokens.items():
            tokens.add_metric([tenant or "default", self.model], value)
        yield tokens


class _EngineTimeCollector(Collector):
    def __init__(self, model: str, read_step_stats: Callable[[], StepStats]) -> None:
        self.model = model
        self.read_step_stats = read_step_stats

    def collect(self) -> Iterable[Metric]:
        stats = self.read_step_stats()
        steps = CounterMetricFamily("mcp2026_engine_steps", "Engine steps run", labels=["model"])
        steps.add_metric([self.model], stats.num_steps)
        yield steps
        busy = CounterMetricFamily(
            "mcp2026_engine_busy_seconds",
            "Engine-loop seconds in model forwards (phase prefill: steps with a prefill chunk; decode: the "
            "rest) and in sampling",
            labels=["model", "phase"],
        )
        for phase, ms in (
            ("prefill", stats.prefill_ms),
            ("decode", stats.decode_ms),
            ("sample", stats.sample_ms),
        ):
            busy.add_metric([self.model, phase], ms / 1e3)
        yield busy
        for name, doc, value in (
            ("mcp2026_spec_decode_drafts", "Speculative decoding: drafts verified", stats.num_drafts),
            (
                "mcp2026_spec_decode_draft_tokens",
                "Speculative decoding: tokens drafted",
                stats.num_draft_tokens,
            ),
            (
                "mcp2026_spec_decode_accepted_tokens",
                "Speculative decoding: drafted tokens the sampler kept (each drafted step also yields one more)",
                stats.num_accepted_tokens,
            ),
        ):
            metric = CounterMetricFamily(name, doc, labels=["model"])
            metric.add_metric([self.model], value)
            yield metric


class _TrafficCollector(Collector):
    def __init__(self, model: str, read_snapshot: Callable[[], TrafficSnapshot]) -> None:
        self.model = model
        self.read_snapshot = read_snapshot

    def collect(self) -> Iterable[Metric]:
        snap = self.read_snapshot()
        gauges = [
            (
                "mcp2026_traffic_long_context_share",
                "Share of recent arrivals with a long context",
                snap.long_share,
            ),
            (
                "mcp2026_traffic_arrival_rate",
                "Arrival rate, EWMA of the per-tick Poisson rate (req/s)",
                snap.arrival_rate,
            ),
            ("mcp2026_traffic_burst_ratio", "Arrival rate over the long-run rate", snap.burst_ratio),
            (
                "mcp2026_traffic_error_rate",
                "Failed share of requests finished in the error window",
                snap.error_rate,
            ),
            (
                "mcp2026_traffic_mean_latency_seconds",
                "Mean E2E latency in the error window",
                snap.mean_latency_s,
            ),
        ]
        for name, doc, value in gauges:
            metric = GaugeMetricFamily(name, doc, labels=["model"])
            metric.add_metric([self.model], value)
            yield metric


class ServerMetrics:
    """Everything /metrics shows; ``observe_*`` are called by the request handlers."""

    def __init__(self, model: str, read_stats: Callable[[], SchedulerStats]) -> None:
        self.model = model
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "mcp2026_time_to_first_token_seconds",
            "Time to first token",
            LABELS,
            registry=r,
            buckets=LATENCY_BUCKETS_S,
        )
        self.tpot = Histogram(
            "mcp2026_time_per_output_token_seconds",
            "Mean time per output token after the first, per request",
            LABELS,
            registry=r,
            buckets=TOKEN_BUCKETS_S,
        )
        self.itl = Histogram(
            "mcp2026_inter_token_latency_seconds",
            "Time between consecutive streamed outputs",
            LABELS,
            registry=r,
            buckets=TOKEN_BUCKETS_S,
        )
        self.e2e = Histogram(
            "mcp2026_e2e_request_latency_seconds",
            "Arrival to last token",
            LABELS,
            registry=r,
            buckets=LATENCY_BUCKETS_S,
        )
        self.queue_time = Histogram(
            "mcp2026_request_queue_time_seconds",
            "Arrival to first scheduled step",
            LABELS,
            registry=r,
            buckets=LATENCY_BUCKETS_S,
        )
        self.prompt_tokens = Counter("mcp2026_prompt_tokens", "Prompt tokens processed", LABELS, registry=r)
        self.generation_tokens = Counter("mcp2026_generation_tokens", "Tokens generated", LABELS, registry=r)
        self.requests = Counter(
            "mcp2026_requests",
            "Requests by outcome (stop, length, abort, error, or rejected_<http status>)",
            (*LABELS, "status"),
            registry=r,
        )
        self.breaker_state = Gauge(
            "mcp2026_breaker_state",
            "SLO circuit breaker: 0 closed, 1 half-open, 2 open",
            ["model"],
            registry=r,
        )
        self.breaker_transitions = Counter(
            "mcp2026_breaker_transitions",
            "SLO circuit breaker transitions by new state",
            ["model", "state"],
            registry=r,
        )
        self.breaker_trips = Counter(
            "mcp2026_breaker_trips", "Times the SLO circuit breaker opened", ["model"], registry=r
        )
        self.gate_switches = Counter(
            "mcp2026_gate_switches",
            "Pressure-gate switches by the plan switched to",
            ["model", "plan"],
            registry=r,
        )
        self.gate_plan = Gauge(
            "mcp2026_gate_plan",
            "1 for the plan the pressure gate has installed",
            ["model", "plan"],
            registry=r,
        )
        self.breaker_state.labels(model).set(0)
        self.breaker_trips.labels(model)
        for plan in (QUALITY, PRESSURE):
            self.gate_switches.labels(model, plan)
            self.gate_plan.labels(model, plan).set(int(plan == QUALITY))
        r.register(_EngineCollector(model, read_stats))

    def watch_engine_time(self, read_step_stats: Callable[[], StepStats]) -> None:
        """Export the engine loop's time in model forwards and sampling, read at scrape time: busy seconds
        over wall seconds is the engine's utilisation (what is left goes to the HTTP side, or idling)."""
        self.registry.register(_EngineTimeCollector(self.model, read_step_stats))

    def watch_traffic(self, read_snapshot: Callable[[], TrafficSnapshot]) -> None:
        """Export the traffic profile's values, read at scrape time."""
        self.registry.register(_TrafficCollector(self.model, read_snapshot))

    def observe_finished(
        self,
        tenant: str,
        status: str,
        *,
        num_prompt_tokens: int,
        num_output_tokens: int,
        ttft_s: float | None,
        e2e_s: float | None,
        queue_s: float | None,
    ) -> None:
        labels = (tenant, self.model)
        self.requests.labels(*labels, status).inc()
        self.prompt_tokens.labels(*labels).inc(num_prompt_tokens)
        self.generation_tokens.labels(*labels).inc(num_output_tokens)
        if ttft_s is not None:
            self.ttft.labels(*labels).observe(ttft_s)
        if e2e_s is not None:
            self.e2e.labels(*labels).observe(e2e_s)
        if queue_s is not None:
            self.queue_time.labels(*labels).observe(queue_s)
        if ttft_s is not None and e2e_s is not None and num_output_tokens > 1:
            self.tpot.labels(*labels).observe((e2e_s - ttft_s) / (num_output_tokens - 1))

    def observe_itl(self, tenant: str, seconds: float) -> None:
        self.itl.labels(tenant, self.model).observe(seconds)

    def observe_rejected(self, tenant: str, http_status: int) -> None:
        self.requests.labels(tenant, self.model, f"rejected_{http_status}").inc()

    def observe_breaker(self, state: str, value: int) -> None:
        self.breaker_state.labels(self.model).set(value)
        self.breaker_transitions.labels(self.model, state).inc()
        if state == "open":
            self.breaker_trips.labels(self.model).inc()

    def observe_gate_switch(self, plan: str) -> None:
        self.gate_switches.labels(self.model, plan).inc()
        for p in (QUALITY, PRESSURE):
            self.gate_plan.labels(self.model, p).set(int(p == plan))

    def render(self) -> bytes:
        return generate_latest(self.registry)
