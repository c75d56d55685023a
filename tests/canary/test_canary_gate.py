"""The decision matrix: every cell (each metric safe / between / trip), its boundaries, intervals, sample
counts, and the verdict's exit code."""

from __future__ import annotations

import itertools

import pytest

from mcp2026.canary.gate import (
    ACCURACY,
    BANDWIDTH,
    EXIT_CODES,
    HOLD,
    LATENCY,
    SAFE,
    TRIP,
    Measurement,
    Thresholds,
    decide,
    evaluate_gate,
    verdict_of,
)

T = Thresholds()  # defaults: latency +15/+30 ms, accuracy -0.3/-0.8 %, bandwidth 72/85 %
# One value per cell, for the default thresholds.
CELLS = {
    LATENCY: {SAFE: 10.0, HOLD: 20.0, TRIP: 40.0},
    ACCURACY: {SAFE: -0.1, HOLD: -0.5, TRIP: -1.0},
    BANDWIDTH: {SAFE: 50.0, HOLD: 80.0, TRIP: 90.0},
}
UNITS = {LATENCY: "ms", ACCURACY: "%", BANDWIDTH: "%"}


def point(kind: str, value: float | None, n: int = 100) -> Measurement:
    return Measurement(f"{kind}_metric", kind, value, UNITS[kind], n)


@pytest.mark.parametrize("cell", list(itertools.product((SAFE, HOLD, TRIP), repeat=3)), ids=str)
def test_every_cell_of_the_matrix(cell):
    statuses = dict(zip((LATENCY, ACCURACY, BANDWIDTH), cell))
    measurements = [point(kind, CELLS[kind][status]) for kind, status in statuses.items()]
    result = evaluate_gate(measurements, T)
    assert [d.status for d in result.decisions] == list(cell)
    expected = "ROLLBACK" if TRIP in cell else "HOLD" if HOLD in cell else "PROMOTE"
    assert result.verdict == expected
    assert result.exit_code == {"PROMOTE": 0, "HOLD": 1, "ROLLBACK": 2}[expected]
    assert result.to_dict()["exit_code"] == result.exit_code


@pytest.mark.parametrize(
    ("kind", "value", "status"),
    [
        (LATENCY, 15.0, SAFE),  # <= +15 ms is safe
        (LATENCY, 15.001, HOLD),
        (LATENCY, 30.0, HOLD),  # > +30 ms trips, exactly +30 does not
        (LATENCY, 30.001, TRIP),
        (LATENCY, -200.0, SAFE),  # faster is safe
        (ACCURACY, -0.3, SAFE),  # >= -0.3 % is safe
        (ACCURACY, -0.301, HOLD),
        (ACCURACY, -0.8, HOLD),  # < -0.8 % trips
        (ACCURACY, -0.801, TRIP),
        (ACCURACY, 2.0, SAFE),  # a better perplexity is safe
        (BANDWIDTH, 72.0, SAFE),
        (BANDWIDTH, 72.5, HOLD),
        (BANDWIDTH, 85.0, HOLD),
        (BANDWIDTH, 85.5, TRIP),
    ],
)
def test_threshold_boundaries(kind, value, status):
    assert decide(point(kind, value), T).status == status


@pytest.mark.parametrize(
    ("kind", "value", "low", "high", "status"),
    [
        (LATENCY, 5.0, -10.0, 14.0, SAFE),  # the whole interval is safe
        (LATENCY, 5.0, -10.0, 16.0, HOLD),  # safe point, but the interval reaches past +15
        (LATENCY, 40.0, 29.0, 50.0, HOLD),  # tripping point, but the interval reaches back to +29
        (LATENCY, 40.0, 31.0, 50.0, TRIP),  # the whole interval trips
        (ACCURACY, -0.1, -0.2, 0.1, SAFE),
        (ACCURACY, -0.1, -0.35, 0.1, HOLD),
        (ACCURACY, -1.0, -1.5, -0.7, HOLD),
        (ACCURACY, -1.0, -1.5, -0.9, TRIP),
    ],
)
def test_the_interval_decides_not_the_point(kind, value, low, high, status):
    m = Measurement("m", kind, value, UNITS[kind], 100, low, high)
    assert decide(m, T).status == status


def test_too_few_samples_hold_even_when_safe():
    d = decide(point(LATENCY, 0.0, n=19), T)
    assert d.status == HOLD and "not enough samples (19 < 20)" in d.reason
    assert decide(point(LATENCY, 0.0, n=20), T).status == SAFE
    # ... even when tripping: a handful of samples cannot roll back either
    assert decide(point(LATENCY, 500.0, n=3), T).status == HOLD


def test_unmeasured_metric_holds_with_its_reason():
    m = Measurement("ppl_change", ACCURACY, None, "%", missing_reason="not measured live")
    d = decide(m, T)
    assert (d.status, d.reason) == (HOLD, "not measured live")
    safe = [point(LATENCY, 0.0), point(BANDWIDTH, 10.0)]
    assert evaluate_gate([*safe, m], T).verdict == "HOLD"


def test_verdict_rules():
    assert verdict_of([SAFE, SAFE]) == "PROMOTE"
    assert verdict_of([SAFE, HOLD]) == "HOLD"
    assert verdict_of([HOLD, TRIP, SAFE]) == "ROLLBACK"
    assert verdict_of([]) == "HOLD"  # no evidence never promotes
    assert EXIT_CODES == {"PROMOTE": 0, "HOLD": 1, "ROLLBACK": 2}
    with pytest.raises(ValueError, match="unknown status"):
        verdict_of(["fine"])


def test_custom_thresholds_move_the_cells():
    strict = Thresholds.from_mapping({"latency_safe_ms": 5, "latency_trip_ms": 8})
    assert decide(point(LATENCY, 10.0), strict).status == TRIP
    assert decide(point(LATENCY, 10.0), T).status == SAFE
    assert strict.min_samples == 20 and isinstance(strict.min_samples, int)


@pytest.mark.parametrize(
    ("raw", "phrase"),
    [
        ({"latency_safe_ms": 40}, "latency_safe_ms (40.0) must be below latency_trip_ms"),
        ({"accuracy_safe_pct": -1.0}, "accuracy_safe_pct (-1.0) must be above accuracy_trip_pct"),
        ({"bandwidth_trip_pct": 50}, "bandwidth_safe_pct (72.0) < bandwidth_trip_pct (50.0)"),
        ({"latency_safe": 1}, "unknown threshold keys ['latency_safe']"),
        ({"min_samples": 2.5}, "min_samples must be an integer"),
        ({"latency_trip_ms": "fast"}, "latency_trip_ms must be a number"),
        ({"confidence": 1.0}, "confidence must be in [0.5, 1)"),
    ],
)
def test_bad_thresholds_say_what_is_wrong(raw, phrase):
    with pytest.raises(ValueError) as e:
        Thresholds.from_mapping(raw, "t.yaml")
    assert phrase in str(e.value) and str(e.value).startswith("t.yaml: ")
