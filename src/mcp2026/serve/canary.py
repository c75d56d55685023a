"""The live canary: inside one ``mcp2026 serve`` process a second engine runs the candidate configuration,
a sticky share of the traffic goes to it, the gate's verdict over both arms is exposed on ``/metrics`` and
``GET /canary``, and, with a ``canary.ramp``, the verdict moves the share (mcp2026.canary.ramp).

Routing is sticky per tenant: sha256(salt, key) mapped to [0, 1) below the current share goes to the
candidate, so raising the share only adds tenants to the candidate. The key is the tenant's name when a keys
file defines tenants; with the single open tenant it is the API key the client sends, else the client's
host. While the candidate engine is not ready (warming up, dead) its share is served by the baseline.

The live verdict gates P99 TTFT and E2E change (each arm's latest ``window`` finished requests, bootstrap
resampling requests per arm: the arms serve different requests, so nothing is paired) and the candidate's
bandwidth utilisation (its engine's decode steps since start). Accuracy is not measured live: it holds,
so the live verdict cannot PROMOTE, unless ``canary.offline_report`` names an offline canary report whose
accuracy metric then counts. A dead candidate engine is ROLLBACK.

With a ramp the verdict that may shift the share is taken on the first request, ``/canary`` or ``/metrics``
call once ``evaluate_every_s`` passed since the last one and both arms' windows hold ``min_samples``
requests; a step up empties both windows, so each step is judged on requests served at that share. A dead
candidate rolls back at once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mcp2026 import hardware
from mcp2026.canary.bandwidth import BandwidthEstimate, estimate_bandwidth
from mcp2026.canary.config import BASELINE, CANDIDATE, CanaryConfig
from mcp2026.canary.gate import (
    ACCURACY,
    LATENCY,
    ROLLBACK,
    GateResult,
    Measurement,
    evaluate_gate,
)
from mcp2026.canary.ramp import Shift, TrafficRamp
from mcp2026.canary.stats import p99, percentile_change_interval
from mcp2026.config import EngineConfig
from mcp2026.engine.async_engine import AsyncEngine
from mcp2026.serve.canary_metrics import attach_canary_metrics
from mcp2026.serve.config import ServeConfig, load_quant_spec, load_serve_yaml

if TYPE_CHECKING:
    from mcp2026.serve.metrics import ServerMetrics
    from mcp2026.serve.tenants import Tenant

log = logging.getLogger("mcp2026.serve")

OK_FINISH = ("stop", "length")
REFRESH_S = 1.0  # the verdict is recomputed at most this often, and only after new requests finished


class ArmTraffic:
    """One arm: its engine, what a decode step of it reads, and its latest finished requests' latencies."""

    def __init__(self, name: str, engine: AsyncEngine, weight_bytes: int, window: int) -> None:
        self.name = name
        self.engine = engine
        self.weight_bytes = weight_bytes
        self.ttft_s: deque[float] = deque(maxlen=window)
        self.e2e_s: deque[float] = deque(maxlen=window)
        self.num_finished = 0
        self.num_failed = 0
        self.histograms: tuple[Any, Any, Any] | None = None  # ttft, e2e, requests; set by attach()

    def observe(self, finish_reason: str, ttft_s: float | None, e2e_s: float | None) -> None:
        """One finished engine request (aborted ones say nothing about the configuration)."""
        if finish_reason == "abort":
            return
        ok = finish_reason in OK_FINISH and ttft_s is not None and e2e_s is not None
        self.num_finished += 1
        self.num_failed += not ok
        if ok:
            self.ttft_s.append(ttft_s)
            self.e2e_s.append(e2e_s)
        if self.histograms is not None:
            ttft, e2e, requests = self.histograms
            requests.inc()
            if ok:
                ttft.observe(ttft_s)
                e2e.observe(e2e_s)

    def clear_window(self) -> None:
        """Forget the latencies so far: the next verdict rests on requests served from now on."""
        self.ttft_s.clear()
        self.e2e_s.clear()

    def bandwidth(self, peak_bytes_per_s: float) -> BandwidthEstimate:
        engine = self.engine.engine
        return estimate_bandwidth(
            self.weight_bytes, engine.cache.bytes_per_token, engine.stats, peak_bytes_per_s
        )

    def summary(self) -> dict[str, Any]:
        return {
            "num_finished": self.num_finished,
            "num_failed": self.num_failed,
            "window": len(self.ttft_s),
            "p99_ttft_ms": p99(self.ttft_s) * 1e3 if self.ttft_s else None,
            "p99_e2e_ms": p99(self.e2e_s) * 1e3 if self.e2e_s else None,
            "ready": self.engine.is_ready,
        }


def offline_accuracy(path: str) -> Measurement:
    """The accuracy metric of an offline ``mcp2026 canary`` report (value, interval, samples)."""
    try:
        report = json.loads(Path(path).read_text(encoding="utf-8"))
        row = next(m for m in report["metrics"] if m["kind"] == ACCURACY)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: offline canary report not found") from None
    except (OSError, ValueError, KeyError, TypeError, StopIteration):
        raise ValueError(f"{path}: not an offline canary report (mcp2026 canary ... writes one)") from None
    return Measurement(
        row["name"],
        ACCURACY,
        row["value"],
        row["unit"],
        row["num_samples"],
        row["low"],
        row["high"],
        missing_reason=f"the offline report {path} did not measure accuracy",
    )


class CanaryRouter:
    def __init__(
        self,
        baseline: AsyncEngine,
        candidate: AsyncEngine,
        config: CanaryConfig,
        *,
        baseline_weight_bytes: int,
        candidate_weight_bytes: int,
        peak_bytes_per_s: float,
        candidate_label: str = "candidate",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``clock``: seconds, for the ramp's evaluation interval (tests pass their own)."""
        self.config = config
        self.thresholds = config.thresholds
        self.peak_bytes_per_s = peak_bytes_per_s
        self.candidate_label = candidate_label  # what the candidate is (its YAML), for /canary
        self.baseline = ArmTraffic(BASELINE, baseline, baseline_weight_bytes, config.window)
        self.candidate = ArmTraffic(CANDIDATE, candidate, candidate_weight_bytes, config.window)
        self.accuracy = offline_accuracy(config.offline_report) if config.offline_report else None
        self._cached: tuple[tuple[int, int], float, GateResult] | None = None
        self.ramp = TrafficRamp(config.ramp, config.candidate_share)
        self.clock = clock
        self._evaluated_at = clock()

    # ---- routing --------------------------------------------------------------------------------
    @staticmethod
    def sticky_key(tenant: Tenant, api_key: str | None, client_host: str | None, is_open: bool) -> str:
        if not is_open:
            return f"tenant:{tenant.name}"
        if api_key:
            return f"key:{api_key}"
        return f"host:{client_host or 'unknown'}"

    def share_of(self, key: str) -> float:
        digest = hashlib.sha256(f"{self.config.salt}\0{key}".encode()).digest()
        return int.from_bytes(digest[:8], "big") / 2.0**64

    def route(self, key: str) -> ArmTraffic:
        self.tick()
        wants_candidate = self.share_of(key) < self.ramp.share
        return self.candidate if wants_candidate and self.candidate.engine.is_ready else self.baseline

    # ---- lifecycle (the baseline engine is the app's own) ------------------------------------------
    def start(self) -> None:
        if not self.candidate.engine.is_started:
            self.candidate.engine.start()

    async def shutdown(self, drain: bool, timeout_s: float = 30.0) -> None:
        await self.candidate.engine.shutdown(drain=drain, timeout_s=timeout_s)

    # ---- the verdict ----------------------------------------------------------------------------
    def measurements(self) -> list[Measurement]:
        t = self.thresholds
        out = []
        for name, attr in (("p99_ttft_change", "ttft_s"), ("p99_e2e_change", "e2e_s")):
            b, c = getattr(self.baseline, attr), getattr(self.candidate, attr)
            if not b or not c:
                out.append(
                    Measurement(
                        name, LATENCY, None, "ms", missing_reason="an arm has no finished request yet"
                    )
                )
                continue
            iv = percentile_change_interval(
                [[x * 1e3] for x in b], [[x * 1e3] for x in c], 99.0, t.confidence, t.bootstrap_resamples
            )
            out.append(Measurement(name, LATENCY, iv.value, "ms", iv.num_samples, iv.low, iv.high))
        out.append(
            self.accuracy
            or Measurement(
                "ppl_change",
                ACCURACY,
                None,
                "%",
                missing_reason="not measured live (set canary.offline_report to an offline canary report)",
            )
        )
        out.append(self.candidate.bandwidth(self.peak_bytes_per_s).measurement())
        return out

    def verdict(self) -> GateResult:
        counts = (self.baseline.num_finished, self.candidate.num_finished)
        now = self.clock()
        if self._cached is not None and (self._cached[0] == counts or now - self._cached[1] < REFRESH_S):
            result = self._cached[2]
        else:
            result = evaluate_gate(self.measurements(), self.thresholds)
            self._cached = (counts, now, result)
        if self.candidate.engine.dead_error is not None:
            return GateResult(result.decisions, ROLLBACK)
        return result

    # ---- the ramp ---------------------------------------------------------------------------------
    def tick(self) -> Shift | None:
        """Shift the share when a verdict is due (see the module docstring); the shift made, if any. Called
        from the event-loop thread only (routing, /canary and /metrics all run there), so it needs no lock."""
        if not self.ramp.can_roll_back:
            return None
        now = self.clock()
        dead = self.candidate.engine.dead_error
        if dead is not None:
            return self._record(self.ramp.roll_back(f"the candidate engine died: {dead}", now))
        num_samples = min(len(self.baseline.ttft_s), len(self.candidate.ttft_s))
        if (
            not self.ramp.is_evaluating
            or now - self._evaluated_at < self.config.evaluate_every_s
            or num_samples < self.thresholds.min_samples
        ):
            return None
        self._evaluated_at = now
        result = evaluate_gate(self.measurements(), self.thresholds)
        self._cached = ((self.baseline.num_finished, self.candidate.num_finished), now, result)
        shift = self.ramp.apply(result, now)
        if shift is None:
            log.debug("canary: candidate share stays %g (%s)", self.ramp.share, result.verdict)
        return self._record(shift)

    def _record(self, shift: Shift | None) -> Shift | None:
        if shift is None:
            return None
        log.log(logging.WARNING if shift.to_share == 0 else logging.INFO, "canary: %s", shift.describe())
        if self.ramp.is_evaluating:  # a step up: judge the new share on its own requests
            self.baseline.clear_window()
            self.candidate.clear_window()
            self._cached = None
        return shift

    def status(self) -> dict[str, Any]:
        """The ``GET /canary`` body."""
        self.tick()
        result = self.verdict()
        dead = self.candidate.engine.dead_error
        return {
            **result.to_dict(),
            "reason": f"the candidate engine died: {dead}" if dead else None,
            "candidate": self.candidate_label,
            "candidate_share": self.ramp.share,
            "ramp": {**self.ramp.to_dict(), "evaluate_every_s": self.config.evaluate_every_s},
            "sticky_by": "tenant (API keys file), else API key, else client host",
            "arms": {a.name: a.summary() for a in (self.baseline, self.candidate)},
            "bandwidth": {
                a.name: a.bandwidth(self.peak_bytes_per_s).to_dict() for a in (self.baseline, self.candidate)
            },
            "accuracy_source": self.config.offline_report or "not measured live",
            "thresholds": self.thresholds.to_dict(),
        }

    # ---- metrics --------------------------------------------------------------------------------
    def attach(self, metrics: ServerMetrics) -> None:
        """Per-arm histograms and the verdict gauges on the server's own registry."""
        attach_canary_metrics(self, metrics.registry, metrics.model)


def read_arm_config(path: str | Path) -> tuple[ServeConfig, EngineConfig]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such configuration file (a serve YAML, see examples/canary/)")
    serve, engine = load_serve_yaml(path)
    if serve.quant is not None:
        load_quant_spec(serve.quant)  # a bad quant YAML (any section) fails here, before any model loads
    return serve, engine


def read_candidate(config: CanaryConfig) -> tuple[Any, Any]:
    """The candidate's serve YAML (and the offline report, if named), checked before any model loads."""
    if config.candidate is None:
        raise ValueError("the live canary needs a candidate serve YAML (--canary-config)")
    if config.offline_report:
        offline_accuracy(config.offline_report)
    return read_arm_config(config.candidate)


def build_router(
    serve_config: ServeConfig,
    baseline_pipe: Any,
    baseline_engine: AsyncEngine,
    load_pipeline: Callable[[ServeConfig, EngineConfig], tuple[Any, Any]],
    candidate_configs: tuple[ServeConfig, EngineConfig] | None = None,
) -> CanaryRouter:
    """Load the candidate named by ``serve_config.canary.candidate`` next to the baseline, with ``load_pipeline``
    (``serve.server.load_pipeline``: a pipeline and its engine thread). ``candidate_configs``: what
    ``read_candidate`` returned (read before the baseline loaded)."""
    config = serve_config.canary
    candidate_serve, candidate_engine_config = candidate_configs or read_candidate(config)
    pipe, compute = load_pipeline(candidate_serve, candidate_engine_config)  # its own engine thread
    b, c = baseline_pipe.engine, pipe.engine
    if b.model_config.vocab_size != c.model_config.vocab_size:
        raise ValueError("the canary candidate has another vocabulary than the served model")
    if c.max_model_len < b.max_model_len:
        raise ValueError(
            f"the canary candidate's context ({c.max_model_len} tokens) is shorter than the served model's "
            f"({b.max_model_len}); set scheduler.max_model_len in the baseline config to at most that"
        )
    return CanaryRouter(
        baseline_engine,
        AsyncEngine(c, warmup=candidate_serve.warmup, compute_thread=compute),
        config,
        baseline_weight_bytes=baseline_pipe.weight_bytes(),
        candidate_weight_bytes=pipe.weight_bytes(),
        peak_bytes_per_s=hardware.peak_read_bandwidth(),
        candidate_label=str(config.candidate),
    )
