"""The serving benchmark's metric math on synthetic timings (vLLM bench-serve definitions), its options and
its per-request plan; no server."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mcp2026.bench.load_generator import LoadGenerator
from mcp2026.bench.serve_config import ServeBenchConfig, parse_goodput
from mcp2026.bench.serve_metrics import RequestResult, compute_metrics, robustness_summary
from mcp2026.bench.workloads import BenchRequest


def result(
    ttft: float,
    latency: float,
    output_tokens: int,
    *,
    prompt_len: int = 10,
    kind: str = "normal",
    success: bool = True,
    status: int = 200,
) -> RequestResult:
    itl = [(latency - ttft) / (output_tokens - 1)] * (output_tokens - 1) if output_tokens > 1 else []
    return RequestResult("r", kind, prompt_len, success, status, output_tokens, ttft, latency, itl)


def test_ttft_tpot_e2e_and_throughput():
    results = [
        result(0.1, 0.5, 5),  # TPOT (0.5 - 0.1) / 4 = 0.1
        result(0.3, 1.1, 9),  # TPOT 0.1
        result(0.2, 0.2, 1),  # one token: no TPOT, no ITL
        result(0.0, 0.0, 0, success=False, status=500),
        result(0.05, 0.1, 2, kind="disconnect"),  # left mid-stream: not in the metrics
    ]
    m = compute_metrics(results, duration_s=2.0)
    assert (m["completed"], m["failed"]) == (3, 1)
    assert m["total_input_tokens"] == 30 and m["total_output_tokens"] == 15
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(7.5)
    assert m["total_token_throughput"] == pytest.approx(22.5)
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["median_ttft_ms"] == pytest.approx(200.0)
    assert m["p99_ttft_ms"] == pytest.approx(float(np.percentile([100, 300, 200], 99)))
    assert m["mean_tpot_ms"] == pytest.approx(100.0) and m["std_tpot_ms"] == pytest.approx(0.0)
    assert m["mean_itl_ms"] == pytest.approx(100.0)
    assert m["mean_e2el_ms"] == pytest.approx((500 + 1100 + 200) / 3)
    assert m["request_goodput"] is None


def test_tpot_with_only_one_token_outputs():
    m = compute_metrics([result(0.1, 0.1, 1), result(0.2, 0.2, 1)], duration_s=1.0, goodput_ms={"tpot": 1.0})
    assert m["mean_tpot_ms"] == 0.0 and m["p90_tpot_ms"] == 0.0 and m["mean_itl_ms"] == 0.0
    assert m["request_goodput"] == pytest.approx(2.0)  # a one-token request's TPOT counts as 0 for goodput


def test_goodput_needs_every_slo():
    results = [result(0.1, 0.5, 5), result(0.3, 1.1, 9), result(0.1, 1.7, 5), result(0.2, 0.2, 1)]
    # TTFT <= 250 ms and TPOT <= 200 ms: #2 misses TTFT (300), #3 misses TPOT (400); #1 and #4 are good.
    m = compute_metrics(results, duration_s=4.0, goodput_ms={"ttft": 250, "tpot": 200})
    assert m["request_goodput"] == pytest.approx(0.5)
    m = compute_metrics(results, duration_s=4.0, goodput_ms={"e2el": 1000})
    assert m["request_goodput"] == pytest.approx(0.5)


def test_robustness_summary_counts_5xx():
    results = [
        result(0.1, 0.2, 2),
        result(0, 0, 0, kind="malformed", status=400, success=True),
        result(0, 0, 0, kind="malformed", status=500, success=False),
    ]
    summary = robustness_summary(results)
    assert summary["num_5xx"] == 1
    assert summary["statuses"]["malformed"] == {"400": 1, "500": 1}


def test_arrivals_are_vllms_schedule():
    """Offsets from the start (vLLM's delay_ts): running sums of seeded Gamma gaps, rescaled in a run of N
    requests so that the last is due at N / rate; duration runs (no N) keep the raw sums."""
    rate, n = 4.0, 100
    for burstiness in (1.0, 0.5):
        gaps = np.random.RandomState(7).gamma(shape=burstiness, scale=1 / (rate * burstiness), size=n)
        generator = LoadGenerator(ServeBenchConfig(request_rate=rate, burstiness=burstiness, seed=7), "m")
        raw = [generator.arrival_offset(i) for i in range(n)]
        assert raw == pytest.approx(np.cumsum(gaps))
        scaled = [generator.arrival_offset(i, n) for i in range(n)]
        assert scaled[-1] == pytest.approx(n / rate)
        assert scaled == pytest.approx(np.cumsum(gaps) * (n / rate) / gaps.sum())
        assert generator.arrival_offset(-1, n) == 0.0  # the start
    everything_at_once = LoadGenerator(ServeBenchConfig(seed=7), "m")
    assert [everything_at_once.arrival_offset(i, n) for i in (0, 50, 99)] == [0.0, 0.0, 0.0]


def test_options_and_goodput_parsing():
    assert parse_goodput(["ttft:1000", "tpot:100"]) == {"ttft": 1000.0, "tpot": 100.0}
    assert parse_goodput(["ttft:1000,tpot:100", "e2el:5000"]) == {"ttft": 1e3, "tpot": 100.0, "e2el": 5e3}
    assert parse_goodput(["ttft:1000 tpot:100"]) == {"ttft": 1000.0, "tpot": 100.0}
    for bad in (["ttft"], ["speed:3"], ["tpot:fast"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)
    with pytest.raises(ValueError, match="request_rate"):
        ServeBenchConfig(request_rate=0)
    with pytest.raises(ValueError, match="share"):
        ServeBenchConfig(disconnect_share=1.5)
    assert math.isinf(ServeBenchConfig().request_rate)


def test_plan_is_seeded_and_follows_the_shares():
    config = ServeBenchConfig(seed=3, disconnect_share=0.2, malformed_share=0.1)
    requests = [BenchRequest(f"q{i}", [1, 2, 3], 8) for i in range(10)]
    generator = LoadGenerator(config, "m")
    plans = [generator.plan_at(requests, i) for i in range(2000)]
    assert [p.kind for p in plans[:50]] == [generator.plan_at(requests, i).kind for i in range(50)]
    kinds = [p.kind for p in plans]
    assert kinds.count("malformed") / 2000 == pytest.approx(0.1, abs=0.03)
    assert kinds.count("disconnect") / 2000 == pytest.approx(0.9 * 0.2, abs=0.03)
    assert all(1 <= p.disconnect_after <= 4 for p in plans)
    assert plans[15].request.request_id == "q5-r15"  # cycled requests get fresh ids
