"""The traffic ramp: PROMOTE steps the candidate's share up the ramp to 1.0, ROLLBACK drops it to 0 and ends
the ramp, HOLD keeps it; without a ramp the share never moves."""

from __future__ import annotations

import pytest

from mcp2026.canary.gate import LATENCY, Measurement, Thresholds, evaluate_gate
from mcp2026.canary.ramp import OBSERVING, PROMOTED, RAMPING, ROLLED_BACK, TrafficRamp, deciding_reason

THRESHOLDS = Thresholds(min_samples=10)


def verdict_from(low: float, high: float):
    """A one-metric gate result: a P99 change interval in ms against the default 15 / 30 ms bands."""
    m = Measurement("p99_e2e_change", LATENCY, (low + high) / 2, "ms", 50, low, high)
    return evaluate_gate([m], THRESHOLDS)


SAFE, HOLDS, TRIPS = verdict_from(-5, 5), verdict_from(10, 40), verdict_from(50, 90)


def test_verdicts_map_to_promote_hold_rollback():
    assert (SAFE.verdict, HOLDS.verdict, TRIPS.verdict) == ("PROMOTE", "HOLD", "ROLLBACK")


def test_promotes_walk_the_ramp_to_one_and_then_stop():
    ramp = TrafficRamp((0.1, 0.25, 1.0), fixed_share=0.1)
    assert (ramp.state, ramp.share) == (RAMPING, 0.1)
    assert ramp.apply(HOLDS, 1.0) is None and ramp.share == 0.1
    first = ramp.apply(SAFE, 2.0)
    assert (first.from_share, first.to_share, first.verdict, first.at_s) == (0.1, 0.25, "PROMOTE", 2.0)
    assert "every metric safe: p99_e2e_change" in first.reason
    assert ramp.state == RAMPING
    last = ramp.apply(SAFE, 3.0)
    assert (last.from_share, last.to_share, ramp.share, ramp.state) == (0.25, 1.0, 1.0, PROMOTED)
    assert not ramp.is_evaluating
    with pytest.raises(RuntimeError, match="promoted"):
        ramp.apply(TRIPS, 4.0)
    assert ramp.num_evaluations == {"PROMOTE": 2, "HOLD": 1, "ROLLBACK": 0}
    assert (ramp.num_shifts("PROMOTE"), ramp.num_shifts("ROLLBACK")) == (2, 0)
    assert first.describe().startswith("candidate share 0.1 -> 0.25 (PROMOTE: every metric safe")


def test_rollback_drops_the_share_to_zero_at_once_and_ends_the_ramp():
    ramp = TrafficRamp((0.1, 0.5, 1.0), fixed_share=0.1)
    ramp.apply(SAFE, 1.0)
    shift = ramp.apply(TRIPS, 2.0)
    assert (shift.from_share, shift.to_share, shift.verdict) == (0.5, 0.0, "ROLLBACK")
    assert shift.reason.startswith("p99_e2e_change [+50, +90] ms > trip +30")
    assert (ramp.share, ramp.state, ramp.is_evaluating, ramp.can_roll_back) == (
        0.0,
        ROLLED_BACK,
        False,
        False,
    )
    assert ramp.roll_back("the candidate engine died", 3.0) is None  # already rolled back: nothing to do
    assert [s.to_share for s in ramp.shifts] == [0.5, 0.0]
    assert ramp.to_dict()["shifts"][-1]["verdict"] == "ROLLBACK"


def test_a_promoted_candidate_can_still_be_rolled_back_when_it_dies():
    ramp = TrafficRamp((0.5, 1.0), fixed_share=0.5)
    ramp.apply(SAFE, 1.0)
    shift = ramp.roll_back("the candidate engine died: boom", 2.0)
    assert (shift.from_share, shift.to_share, ramp.state) == (1.0, 0.0, ROLLED_BACK)


def test_without_a_ramp_the_share_is_only_observed():
    ramp = TrafficRamp((), fixed_share=0.3)
    assert (ramp.state, ramp.share, ramp.is_evaluating, ramp.can_roll_back) == (OBSERVING, 0.3, False, False)
    assert ramp.roll_back("the candidate engine died", 1.0) is None
    assert ramp.share == 0.3 and ramp.shifts == []


def test_deciding_reason_names_the_metrics_that_decided():
    assert deciding_reason(HOLDS).startswith("p99_e2e_change [+10, +40] ms past the safe threshold")
    assert deciding_reason(evaluate_gate([], THRESHOLDS)) == "no metric measured"
