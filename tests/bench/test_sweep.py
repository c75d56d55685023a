"""`bench sweep`: the configuration grid, and a short sweep of a tiny random model served in-process
(2 configs x 2 rates x 4 prompts) with its rows, Pareto marks, KV timelines and plots."""

from __future__ import annotations

import json
import math
import random

import pytest
from typer.testing import CliRunner

from mcp2026.bench.cli import bench_app
from mcp2026.bench.figures import write_report
from mcp2026.bench.pareto import pareto_front
from mcp2026.bench.sweep import SweepConfig, run_sweep
from mcp2026.bench.sweep_grid import GridAxes, build_grid, parse_list

from conftest import save_tiny_hf

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(save_tiny_hf(tmp_path_factory.mktemp("tiny_sweep"), max_position_embeddings=256))


def test_grid_crosses_configs_and_axes(tmp_path):
    (tmp_path / "small.yaml").write_text("dtype: fp32\nscheduler:\n  max_num_seqs: 2\n")
    (tmp_path / "big.yaml").write_text("dtype: fp32\nkv:\n  num_blocks: 64\n")
    configs = [tmp_path / "small.yaml", tmp_path / "big.yaml"]
    points = build_grid(configs, GridAxes(max_num_batched_tokens=(512, 2048), kv_dtypes=("none", "int8")))
    assert [p.name for p in points][:4] == [
        "small tokens=512 kv=none",
        "small tokens=512 kv=int8",
        "small tokens=2048 kv=none",
        "small tokens=2048 kv=int8",
    ]
    assert len(points) == 8
    first, second = points[0], points[1]
    assert first.engine.scheduler.max_num_seqs == 2 and first.engine.scheduler.max_num_batched_tokens == 512
    assert first.engine.kv_compressor is None and second.engine.kv_compressor.dtype == "int8"
    assert points[4].engine.kv.num_blocks == 64
    (only,) = build_grid(model="m.gguf", dtype="bf16")
    assert only.name == "default" and only.serve.model == "m.gguf" and only.serve.dtype == "bf16"
    (quant,) = build_grid(axes=GridAxes(quants=("examples/quant/w8.yaml",), kv_policies=("heavy_hitter",)))
    assert quant.name == "policy=heavy_hitter quant=w8" and quant.serve.quant.endswith("w8.yaml")
    assert quant.engine.kv_compressor.policy == "heavy_hitter"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"axes": GridAxes(kv_sparsity=0.5)}, "--kv-sparsity needs an eviction policy"),
        ({"axes": GridAxes(kv_dtypes=("int3",))}, "int3"),
        ({"axes": GridAxes(max_num_seqs=(0,))}, "max_num_seqs must be >= 1"),
        ({"axes": GridAxes(quants=("missing.yaml",))}, "missing.yaml"),
        ({"configs": ["nope.yaml"]}, "nope.yaml: serve config YAML not found"),
    ],
)
def test_grid_rejects_bad_values_before_loading(kwargs, message):
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        build_grid(**kwargs)


def test_options_parse_with_clear_errors():
    assert parse_list("8, 32,", int, "--max-num-seqs") == (8, 32)
    with pytest.raises(ValueError, match="--max-num-seqs: expected comma-separated ints"):
        parse_list("8,lots", int, "--max-num-seqs")
    with pytest.raises(ValueError, match="latency_metric"):
        SweepConfig(latency_metric="fastest")
    with pytest.raises(ValueError, match="rates"):
        SweepConfig(rates=(1.0, 0.0))
    with pytest.raises(ValueError, match="burstiness"):
        SweepConfig(burstiness=0.0)


def test_sweep_on_a_tiny_model(tiny_dir, tmp_path):
    points = build_grid(axes=GridAxes(kv_dtypes=("none", "int4")), model=tiny_dir, dtype="fp32")
    config = SweepConfig(rates=(40.0, 200.0), num_prompts=4, input_len=12, output_len=4, kv_sample_s=0.01)
    rng = random.Random(0)
    windows = [[rng.randrange(320) for _ in range(64)] for _ in range(2)]
    run = run_sweep(config, points, windows=windows)

    assert [(r["config"], r["rate"]) for r in run.records] == [
        ("kv=none", 40.0), ("kv=none", 200.0), ("kv=int4", 40.0), ("kv=int4", 200.0)
    ]  # fmt: skip
    for row in run.records:
        assert row["completed"] == 4 and row["failed"] == 0 and row["output_throughput"] > 0
        assert 0 < row["median_ttft_ms"] <= row["median_e2el_ms"]
        assert len(row["requests"]) == 4 and all(r["output_tokens"] == 4 for r in row["requests"])
        timeline = row["kv_timeline"]
        assert len(timeline["t_s"]) == len(timeline["blocks_used"]) >= 2
        assert 0 < row["kv_peak_blocks"] <= timeline["num_blocks"]
    configs = run.aggregates["configs"]
    ppl_none, ppl_int4 = configs["kv=none"]["ppl"], configs["kv=int4"]["ppl"]
    assert configs["kv=none"]["ppl_tokens"] == 2 * 31  # positions 32..62 of each 64-token window
    assert math.isfinite(ppl_none) and ppl_int4 != ppl_none  # int4 KV is read back by the later chunks
    assert configs["kv=int4"]["kv_compressor"]["dtype"] == "int4"

    metric = config.latency_metric
    expected_t = set(pareto_front(run.records, minimize=[metric], maximize=["output_throughput"]))
    expected_q = set(pareto_front(run.records, minimize=[metric, "ppl"]))
    assert {i for i, r in enumerate(run.records) if r["throughput_front"]} == expected_t != set()
    assert {i for i, r in enumerate(run.records) if r["quality_front"]} == expected_q != set()
    assert len(run.tables[0].rows) == 4 and run.tables[1].rows[1][4] == "int4"

    _, figures = write_report([("sweep", run)], tmp_path)
    drawn = {p.name for _, p in figures.paths}
    assert drawn == {
        "latency-cdf.png",
        "throughput-vs-rate.png",
        "ppl-front.png",
        "throughput-front.png",
        "kv-usage.png",
    }
    assert figures.skipped == [
        "Bit plan heatmap: no quantized model in these runs; pass --plan ARTIFACT_DIR or plan.json"
    ]


def test_bench_sweep_command(tiny_dir, tmp_path, monkeypatch):
    import mcp2026.bench.sweep as sweep_module

    loads = []  # the load generator's config of every (config, rate)
    real_bench_serve = sweep_module.bench_serve
    monkeypatch.setattr(
        sweep_module, "bench_serve", lambda c, *a, **k: loads.append(c) or real_bench_serve(c, *a, **k)
    )
    args = ["sweep", "--model", tiny_dir, "--dtype", "fp32", "--rates", "50,inf", "--max-num-seqs", "1,4"]
    args += [
        "--burstiness",
        "0.5",
        "--num-prompts",
        "3",
        "--input-len",
        "8",
        "--output-len",
        "3",
        "--no-progress",
        "--out",
        str(tmp_path),
    ]
    result = CliRunner().invoke(bench_app, args)
    assert result.exit_code == 0, result.output
    (path,) = tmp_path.glob("*-sweep.json")
    data = json.loads(path.read_text())
    assert len(data["records"]) == 4 and all(r["completed"] == 3 for r in data["records"])
    assert (
        data["command"].startswith("mcp2026 bench sweep --rates 50,inf")
        and "--max-num-seqs 1,4" in data["command"]
    )
    assert any("no perplexity" in note and "no tokenizer" in note for note in data["notes"])
    assert data["config"]["burstiness"] == 0.5 and "--burstiness 0.5" in data["command"]
    assert [c.burstiness for c in loads] == [0.5] * 4  # every rate's arrivals
    report = tmp_path / f"{path.stem}-report"
    assert (report / "throughput-vs-rate.png").exists() and not (report / "ppl-front.png").exists()
    assert "PPL vs latency front" in (report / "report.md").read_text()  # listed as not drawn
    bad = CliRunner().invoke(bench_app, ["sweep", "--rates", "fast"])
    assert bad.exit_code == 2 and "--rates" in bad.output
