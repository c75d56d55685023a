"""P99 on synthetic lists, and the bootstrap intervals: a noisy small sample holds even when its point
estimate is safe; pairing blocks cancels what the blocks hold."""

from __future__ import annotations

import math

import pytest

from mcp2026.canary.gate import HOLD, LATENCY, SAFE, Measurement, Thresholds, decide
from mcp2026.canary.stats import (
    p99,
    percentile,
    percentile_change_interval,
    ppl_change_interval,
    ppl_change_pct,
)


def test_p99_interpolates_between_order_statistics():
    assert p99(list(range(1, 101))) == pytest.approx(99.01)  # rank 0.99 * 99 = 98.01
    assert p99([0.0, 100.0]) == pytest.approx(99.0)
    assert p99([7.0]) == 7.0
    assert p99([3.0, 1.0, 2.0]) == pytest.approx(2.98)  # order does not matter
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    with pytest.raises(ValueError, match="no samples"):
        p99([])
    with pytest.raises(ValueError, match="q must be in"):
        percentile([1.0], 101)


def test_noisy_small_sample_holds_although_its_point_estimate_is_safe():
    # One slow outlier per arm: the P99s differ by ~8 ms, but which outliers a rerun would see is luck.
    baseline = [100.0] * 19 + [300.0]
    candidate = [100.0] * 19 + [310.0]
    iv = percentile_change_interval([[x] for x in baseline], [[x] for x in candidate], seed=0)
    assert iv.value == pytest.approx(8.1)
    assert iv.num_samples == 20
    assert iv.low < -100 and iv.high > 100
    m = Measurement("p99_e2e_change", LATENCY, iv.value, "ms", iv.num_samples, iv.low, iv.high)
    assert decide(m, Thresholds()).status == HOLD
    assert decide(Measurement("p", LATENCY, iv.value, "ms", iv.num_samples), Thresholds()).status == SAFE


def test_a_consistent_change_gets_a_tight_interval():
    baseline = [50.0 + (i % 5) for i in range(200)]
    candidate = [x + 3.0 for x in baseline]
    iv = percentile_change_interval([[x] for x in baseline], [[x] for x in candidate], seed=1)
    assert iv.value == pytest.approx(3.0)
    assert -1.0 < iv.low <= 3.0 <= iv.high < 7.0


def test_paired_blocks_cancel_what_the_blocks_hold():
    # Blocks differ wildly (long vs short prompts), the candidate is +5 ms on every request.
    baseline = [[10.0, 11.0], [500.0, 520.0], [40.0, 41.0], [900.0, 950.0], [20.0, 22.0]]
    candidate = [[x + 5.0 for x in block] for block in baseline]
    paired = percentile_change_interval(baseline, candidate, seed=0, paired=True)
    assert paired.value == pytest.approx(5.0)
    assert paired.low == pytest.approx(5.0) and paired.high == pytest.approx(5.0)
    unpaired = percentile_change_interval(baseline, candidate, seed=0)
    assert unpaired.high - unpaired.low > 100
    assert paired.num_samples == 10


def test_paired_blocks_skip_empty_blocks_and_need_equal_counts():
    iv = percentile_change_interval([[1.0], [], [3.0]], [[2.0], [9.0], [4.0]], seed=0, paired=True)
    assert iv.num_samples == 2  # block 1 has no baseline sample: dropped from both arms
    with pytest.raises(ValueError, match="equal counts"):
        percentile_change_interval([[1.0]], [[1.0], [2.0]], paired=True)
    with pytest.raises(ValueError, match="at least one sample"):
        percentile_change_interval([[]], [[1.0]])


def test_ppl_change_in_percent():
    # candidate NLL higher by ln(1.01) per token: PPL 1% higher, a -1% change
    assert ppl_change_pct(100 * math.log(1.01), 100) == pytest.approx(-1.0)
    assert ppl_change_pct(-100 * math.log(1.02), 100) == pytest.approx(100 * (1 - 1 / 1.02))
    iv = ppl_change_interval([math.log(1.01) * 32] * 20, [32] * 20, seed=0)
    assert iv.value == pytest.approx(-1.0)
    assert iv.low == pytest.approx(-1.0) and iv.high == pytest.approx(-1.0)  # identical blocks: no spread
    assert iv.num_samples == 20
    noisy = ppl_change_interval([(-1) ** i * 3.0 for i in range(20)], [32] * 20, seed=0)
    assert noisy.low < noisy.value < noisy.high
    with pytest.raises(ValueError, match="positive token count"):
        ppl_change_interval([1.0], [0])
