"""The release gate: thresholds per metric (the decision matrix), one decision per measured metric, and the
verdict with its exit code. Pure Python, so CI tooling can import it without torch.

Each metric is classified from its confidence interval, not from its point estimate alone: "safe" only if
the whole interval is on the safe side of the safe threshold, "trip" only if the whole interval is beyond
the trip threshold, otherwise "hold". Too few samples is "hold" too, so a noisy run never promotes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

SAFE, HOLD, TRIP = "safe", "hold", "trip"
STATUS_VALUES = {SAFE: 0, HOLD: 1, TRIP: 2}
PROMOTE, ROLLBACK = "PROMOTE", "ROLLBACK"
VERDICT_HOLD = "HOLD"
VERDICTS = (PROMOTE, VERDICT_HOLD, ROLLBACK)
EXIT_CODES = {PROMOTE: 0, VERDICT_HOLD: 1, ROLLBACK: 2}
BAD_INPUT_EXIT_CODE = 3  # 2 is ROLLBACK here, so bad input must not use the CLI's usual 2
LATENCY, ACCURACY, BANDWIDTH = "latency", "accuracy", "bandwidth"
KINDS = (LATENCY, ACCURACY, BANDWIDTH)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True)
class Band:
    """One row of the matrix. ``higher_is_worse``: latency and bandwidth grow worse upwards, accuracy
    delta (negative = worse) downwards."""

    safe: float
    trip: float
    higher_is_worse: bool


@dataclass(frozen=True)
class Thresholds:
    """The decision matrix (defaults: docs/canary.md) and how much evidence a decision needs."""

    latency_safe_ms: float = 15.0  # P99 change, candidate minus baseline: <= safe
    latency_trip_ms: float = 30.0  # > trip
    accuracy_safe_pct: float = -0.3  # perplexity change in %, negative = worse: >= safe
    accuracy_trip_pct: float = -0.8  # < trip
    bandwidth_safe_pct: float = 72.0  # candidate's memory bandwidth utilisation: <= safe
    bandwidth_trip_pct: float = 85.0  # > trip
    min_samples: int = 20  # fewer samples (requests per arm, NLL blocks, decode steps): hold
    confidence: float = 0.95  # of the bootstrap intervals
    bootstrap_resamples: int = 2000

    def __post_init__(self) -> None:
        _require(
            self.latency_safe_ms < self.latency_trip_ms,
            f"latency_safe_ms ({self.latency_safe_ms}) must be below latency_trip_ms ({self.latency_trip_ms})",
        )
        _require(
            self.accuracy_safe_pct > self.accuracy_trip_pct,
            f"accuracy_safe_pct ({self.accuracy_safe_pct}) must be above accuracy_trip_pct "
            f"({self.accuracy_trip_pct}): accuracy deltas are negative when the candidate is worse",
        )
        _require(
            0 < self.bandwidth_safe_pct < self.bandwidth_trip_pct,
            f"need 0 < bandwidth_safe_pct ({self.bandwidth_safe_pct}) < bandwidth_trip_pct "
            f"({self.bandwidth_trip_pct})",
        )
        _require(self.min_samples >= 1, f"min_samples must be >= 1, got {self.min_samples}")
        _require(0.5 <= self.confidence < 1, f"confidence must be in [0.5, 1), got {self.confidence}")
        _require(
            self.bootstrap_resamples >= 100,
            f"bootstrap_resamples must be >= 100, got {self.bootstrap_resamples}",
        )

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any], source: str = "thresholds") -> Thresholds:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        _require(not unknown, f"{source}: unknown threshold keys {unknown}; known: {sorted(known)}")
        values = {}
        for key, value in raw.items():
            wants_int = isinstance(getattr(cls, key), int)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            ok = ok and (not wants_int or float(value).is_integer())
            _require(
                ok, f"{source}: {key} must be {'an integer' if wants_int else 'a number'}, got {value!r}"
            )
            values[key] = int(value) if wants_int else float(value)
        try:
            return cls(**values)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None

    def band(self, kind: str) -> Band:
        if kind == LATENCY:
            return Band(self.latency_safe_ms, self.latency_trip_ms, higher_is_worse=True)
        if kind == ACCURACY:
            return Band(self.accuracy_safe_pct, self.accuracy_trip_pct, higher_is_worse=False)
        if kind == BANDWIDTH:
            return Band(self.bandwidth_safe_pct, self.bandwidth_trip_pct, higher_is_worse=True)
        raise ValueError(f"unknown metric kind {kind!r}; one of {KINDS}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Measurement:
    """One release metric as measured: point estimate, confidence interval (None: a point estimate with
    no interval) and how many samples it rests on."""

    name: str
    kind: str  # latency | accuracy | bandwidth
    value: float | None
    unit: str
    num_samples: int = 0
    low: float | None = None
    high: float | None = None
    missing_reason: str = "not measured"  # why value is None


@dataclass(frozen=True)
class Decision:
    measurement: Measurement
    status: str  # safe | hold | trip
    reason: str
    band: Band

    def to_dict(self) -> dict[str, Any]:
        m = self.measurement
        return {
            "name": m.name,
            "kind": m.kind,
            "value": m.value,
            "low": m.low,
            "high": m.high,
            "unit": m.unit,
            "num_samples": m.num_samples,
            "safe": self.band.safe,
            "trip": self.band.trip,
            "status": self.status,
            "reason": self.reason,
        }


def _fmt(x: float) -> str:
    return f"{x + 0.0:+.4g}"  # + 0.0: no "-0"


def decide(m: Measurement, thresholds: Thresholds) -> Decision:
    band = thresholds.band(m.kind)
    if m.value is None:
        return Decision(m, HOLD, m.missing_reason, band)
    if m.num_samples < thresholds.min_samples:
        reason = f"not enough samples ({m.num_samples} < {thresholds.min_samples})"
        return Decision(m, HOLD, reason, band)
    low = m.value if m.low is None else m.low
    high = m.value if m.high is None else m.high
    span = f"[{_fmt(low)}, {_fmt(high)}] {m.unit}" if m.low is not None else f"{_fmt(m.value)} {m.unit}"
    if band.higher_is_worse:
        if high <= band.safe:
            return Decision(m, SAFE, f"{span} <= safe {_fmt(band.safe)}", band)
        if low > band.trip:
            return Decision(m, TRIP, f"{span} > trip {_fmt(band.trip)}", band)
        where = "past the safe threshold" if m.value > band.safe else "reaching past the safe threshold"
        return Decision(m, HOLD, f"{span} {where}, not wholly beyond trip {_fmt(band.trip)}", band)
    if low >= band.safe:
        return Decision(m, SAFE, f"{span} >= safe {_fmt(band.safe)}", band)
    if high < band.trip:
        return Decision(m, TRIP, f"{span} < trip {_fmt(band.trip)}", band)
    where = "below the safe threshold" if m.value < band.safe else "reaching below the safe threshold"
    return Decision(m, HOLD, f"{span} {where}, not wholly beyond trip {_fmt(band.trip)}", band)


def verdict_of(statuses: Iterable[str]) -> str:
    """ROLLBACK if any metric trips, else HOLD if any holds, else PROMOTE (no metric at all: HOLD)."""
    statuses = list(statuses)
    for s in statuses:
        _require(s in STATUS_VALUES, f"unknown status {s!r}")
    if TRIP in statuses:
        return ROLLBACK
    if HOLD in statuses or not statuses:
        return VERDICT_HOLD
    return PROMOTE


@dataclass(frozen=True)
class GateResult:
    decisions: tuple[Decision, ...]
    verdict: str

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.verdict]

    def to_dict(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "exit_code": self.exit_code,
            "metrics": [d.to_dict() for d in self.decisions],
        }


def evaluate_gate(measurements: Iterable[Measurement], thresholds: Thresholds) -> GateResult:
    decisions = tuple(decide(m, thresholds) for m in measurements)
    return GateResult(decisions, verdict_of(d.status for d in decisions))
