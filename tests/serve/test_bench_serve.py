"""The serving load generator against a live local server: streaming metrics, clients that disconnect
mid-stream and malformed requests (no 5xx, no block left held), and the `bench serve` command."""

from __future__ import annotations

import json

import pytest
from serve_helpers import MODEL, live_server
from typer.testing import CliRunner

from mcp2026.bench.serve import bench_serve
from mcp2026.bench.serve_cli import serve_app
from mcp2026.bench.serve_config import ServeBenchConfig
from mcp2026.bench.workloads import BenchRequest


def test_load_generator_measures_and_the_server_stays_clean():
    requests = [BenchRequest(f"q{i}", [100 + i + j for j in range(12 + 4 * i)], 6) for i in range(16)]
    with live_server() as live:
        config = ServeBenchConfig(
            base_url=live.url,
            request_rate=200.0,
            max_concurrency=6,
            seed=1,
            goodput_ms={"ttft": 60_000, "tpot": 60_000},
            disconnect_share=0.25,
            malformed_share=0.25,
            check_server=True,
            detailed=True,
        )
        run = bench_serve(config, requests)
        live.wait_blocks_back()
    agg = run.aggregates
    kinds = [r["kind"] for r in run.records]
    assert run.config["model"] == MODEL and len(run.records) == 16
    assert {"normal", "disconnect", "malformed"} <= set(kinds)
    assert agg["num_5xx"] == 0 and agg["num_no_response"] == 0
    assert agg["server_after"]["idle"], agg["server_after"]
    assert all(r["status"] // 100 == 4 for r in run.records if r["kind"] == "malformed")
    normal = [r for r in run.records if r["kind"] == "normal"]
    assert agg["completed"] == len(normal) and agg["failed"] == 0
    for r in normal:
        assert r["output_tokens"] == 6 and 0 < r["ttft"] <= r["latency"] and 1 <= len(r["itl"]) <= 5
        assert sum(r["itl"]) == pytest.approx(r["latency"] - r["ttft"], abs=1e-6)  # first to last token
    assert agg["total_output_tokens"] == 6 * len(normal)
    assert agg["request_goodput"] == agg["request_throughput"]  # generous SLOs: every request is good
    assert agg["p99_ttft_ms"] >= agg["median_ttft_ms"] > 0 and agg["mean_tpot_ms"] > 0
    assert run.tables[0].rows[0] == ["successful requests", len(normal)]
    usage = agg["kv_usage"]  # sampled from /metrics while the load ran
    assert usage["metric"] == "mcp2026_kv_cache_usage_ratio" and len(usage["t_s"]) == len(usage["share"]) >= 1
    assert all(0.0 <= x <= 1.0 for x in usage["share"]) and usage["t_s"] == sorted(usage["t_s"])


def test_bench_serve_command(tmp_path):
    with live_server() as live:
        args = ["--base-url", live.url, "--workload", "random", "--num-prompts", "4", "--input-len", "16"]
        args += ["--output-len", "3", "--max-concurrency", "2", "--goodput", "ttft:60000", "--check-server"]
        result = CliRunner().invoke(serve_app, [*args, "--no-progress", "--out", str(tmp_path)])
        assert result.exit_code == 0, result.output
        bad = CliRunner().invoke(serve_app, ["--base-url", live.url, "--goodput", "speed:1", "--no-progress"])
        assert bad.exit_code == 2 and "goodput" in bad.output
    (path,) = tmp_path.glob("*-serve.json")
    data = json.loads(path.read_text())
    assert data["aggregates"]["completed"] == 4 and data["aggregates"]["total_output_tokens"] == 12
    assert "TTFT" in result.output
