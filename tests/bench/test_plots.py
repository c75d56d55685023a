"""Report plots: every plot function writes a valid PNG, refuses to draw nothing, and `bench report`
writes report.md with the plots the runs support (and says which it skipped)."""

from __future__ import annotations

import json

import pytest
from PIL import Image
from typer.testing import CliRunner

from mcp2026.bench import plots
from mcp2026.bench.bitplan import model_layer_bits, plan_layer_bits, read_layer_bits
from mcp2026.bench.cli import bench_app
from mcp2026.bench.figures import latency_samples, rate_series, write_report
from mcp2026.bench.offline import OfflineConfig, run_offline
from mcp2026.bench.report import BenchRun, write_run
from mcp2026.config import ModelConfig
from mcp2026.quant.plan import LayerQuantSpec, QuantPlan

from conftest import save_tiny_hf

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TINY = ModelConfig("llama", 320, 64, 128, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16)


def assert_png(path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE), path
    with Image.open(path) as image:
        assert image.format == "PNG" and image.width > 100 and image.height > 100
        image.verify()


def serve_run(rate: float, ttfts: list[float], kv_usage: dict | None = None) -> BenchRun:
    records = [
        {"kind": "normal", "success": True, "ttft": t, "latency": t + 0.5, "output_tokens": 6} for t in ttfts
    ]
    records.append({"kind": "normal", "success": False, "ttft": 0.0, "latency": 0.0, "output_tokens": 0})
    return BenchRun(
        kind="serve",
        command="mcp2026 bench serve",
        config={"request_rate": rate, "model": "tiny", "base_url": "http://127.0.0.1:1"},
        records=records,
        aggregates={"output_throughput": 10.0 * rate, "kv_usage": kv_usage},
    )


def sweep_run() -> BenchRun:
    rows = []
    for config, ppl, speed in (("a", 5.0, 1.0), ("b", 6.0, 0.5)):
        for rate in (1.0, 2.0):
            rows.append(
                {
                    "config": config,
                    "rate": rate,
                    "completed": 4,
                    "failed": 0,
                    "output_throughput": 20 * rate * speed,
                    "median_e2el_ms": 100 * rate * speed,
                    "ppl": ppl,
                    "throughput_front": config == "b",
                    "quality_front": config == "a" or rate == 1.0,
                    "kv_timeline": {"t_s": [0.0, 0.1, 0.2], "blocks_used": [0, 3, 1], "num_blocks": 8},
                }
            )
    bits = plan_layer_bits(QuantPlan({"layers.0.*": "int8", "_default": LayerQuantSpec("int4", 64)}), TINY)
    return BenchRun(
        kind="sweep",
        command="mcp2026 bench sweep",
        config={"latency_metric": "median_e2el_ms"},
        records=rows,
        aggregates={"layer_bits": {"a": bits}},
    )


def test_each_plot_writes_a_png(tmp_path):
    paths = [
        plots.latency_cdfs(
            {"run": {"ttft": [1, 5, 3], "tpot": [2, 2.5], "e2e": [10, 12]}}, tmp_path / "cdf.png"
        ),
        plots.throughput_vs_rate(
            {"ours": [(2, 40.0), (1, 20.0), (float("inf"), 80.0)]}, tmp_path / "rate.png"
        ),
        plots.pareto_plot(
            [plots.ParetoPoint(1, 5, "a", True), plots.ParetoPoint(2, 6, "b", False)],
            tmp_path / "p.png",
            "ms",
            "PPL",
        ),
        plots.bit_plan_heatmap(
            {"layers.0.attn.qkv_proj": 8.0, "layers.1.mlp.down_proj": 4.5, "lm_head": 32},
            tmp_path / "bits.png",
        ),
        plots.kv_usage_over_time({"run": ([0, 1, 2], [0, 4, 2])}, tmp_path / "kv.png", {"run": 8}),
    ]
    for path in paths:
        assert_png(path)


@pytest.mark.parametrize(
    "draw, message",
    [
        (lambda p: plots.latency_cdfs({"run": {"ttft": []}}, p), "per-request"),
        (lambda p: plots.throughput_vs_rate({"ours": [(float("inf"), 1.0)]}, p), "finite request rate"),
        (lambda p: plots.pareto_plot([], p, "ms", "PPL"), "PPL vs ms"),
        (lambda p: plots.bit_plan_heatmap({"lm_head": 8.0}, p), "per-layer bits"),
        (lambda p: plots.kv_usage_over_time({"run": ([], [])}, p), "sampled KV blocks"),
    ],
)
def test_no_data_is_a_clear_error_and_no_file(tmp_path, draw, message):
    with pytest.raises(plots.NoPlotData, match=message):
        draw(tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_bit_plan_from_a_plan_and_from_a_model():
    bits = plan_layer_bits(QuantPlan({"layers.0.*": "int8", "_default": LayerQuantSpec("int4", 64)}), TINY)
    assert bits["layers.0.attn.qkv_proj"] == pytest.approx(8 + 16 / 64)
    assert bits["layers.2.mlp.down_proj"] == 4.5 and bits["lm_head"] == 4.5
    assert len(bits) == 3 * 4 + 1  # qkv, o, gate_up, down per layer + lm_head
    untouched = plan_layer_bits(QuantPlan({"layers.1.mlp.*": "int8"}), TINY, dense_bits=16.0)
    assert untouched["layers.0.attn.o_proj"] == 16.0 and untouched["layers.1.mlp.down_proj"] > 8

    from mcp2026.models.registry import build_model

    assert set(model_layer_bits(build_model(TINY))) == set(bits)
    assert set(model_layer_bits(build_model(TINY)).values()) == {32.0}


def tiny_config_dir(path):
    """Just the config.json of a 2-layer Llama: read_layer_bits needs the shape, not the weights."""
    path.mkdir()
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 320, "hidden_size": 64, "num_hidden_layers": 2,
              "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_read_layer_bits_from_plan_json(tmp_path):
    model = tiny_config_dir(tmp_path / "tiny")
    (tmp_path / "plan.json").write_text(QuantPlan.uniform("int8").to_json())
    bits = read_layer_bits(tmp_path / "plan.json", model)
    assert len(bits) == 2 * 4 + 1 and all(8 < b < 8.5 for b in bits.values())
    with pytest.raises(ValueError, match="not a compiled artifact"):
        read_layer_bits(tmp_path, model)
    with pytest.raises(FileNotFoundError, match="no such plan"):
        read_layer_bits(tmp_path / "missing.json", model)


def test_figure_data_from_runs():
    samples = latency_samples(serve_run(1.0, [0.1, 0.2]), "s")["s"]
    assert samples["ttft"] == pytest.approx([100, 200]) and samples["e2e"] == pytest.approx([600, 700])
    assert samples["tpot"] == pytest.approx([100, 100])  # 500 ms over 5 tokens after the first
    series = rate_series([("s1", serve_run(1.0, [0.1])), ("s2", serve_run(2.0, [0.1])), ("sw", sweep_run())])
    assert series["serve tiny @ http://127.0.0.1:1"] == [(1.0, 10.0), (2.0, 20.0)]
    assert series["a"] == [(1.0, 20.0), (2.0, 40.0)] and series["b"] == [(1.0, 10.0), (2.0, 20.0)]


def test_write_report_draws_what_the_runs_support(tmp_path):
    usage = {"metric": "mcp2026_kv_cache_usage_ratio", "t_s": [0.0, 0.5, 1.0], "share": [0.0, 0.4, 0.1]}
    runs = [
        ("serve-1", serve_run(1.0, [0.1, 0.3], usage)),
        ("serve-2", serve_run(2.0, [0.2, 0.4])),
        ("sw", sweep_run()),
    ]
    report, figures = write_report(runs, tmp_path / "rep")
    names = sorted(p.name for _, p in figures.paths)
    assert names == [
        "bit-plan.png",
        "kv-usage-serve.png",
        "kv-usage.png",
        "latency-cdf.png",
        "ppl-front.png",
        "throughput-front.png",
        "throughput-vs-rate.png",
    ]
    assert figures.skipped == []
    for _, path in figures.paths:
        assert_png(path)
    text = report.read_text()
    assert "![Latency CDFs](latency-cdf.png)" in text and "## sw (sweep)" in text

    only_serve, figures = write_report(runs[:1], tmp_path / "serve-only")
    assert {p.name for _, p in figures.paths} == {
        "latency-cdf.png",
        "throughput-vs-rate.png",
        "kv-usage-serve.png",
    }
    skipped = " ".join(figures.skipped)
    assert "need a sweep run" in skipped and "--plan" in skipped and "KV usage" in skipped
    assert "Not drawn:" in only_serve.read_text()


def test_bench_report_command(tmp_path):
    path = write_run(sweep_run(), tmp_path)
    (tmp_path / "plan.json").write_text(QuantPlan.uniform("int4", group_size=32).to_json())
    model = tiny_config_dir(tmp_path / "tiny")
    args = [
        str(path),
        "--plots",
        str(tmp_path / "out"),
        "--plan",
        str(tmp_path / "plan.json"),
        "--model",
        str(model),
    ]
    result = CliRunner().invoke(bench_app, ["report", *args])
    assert result.exit_code == 0, result.output
    assert {p.name for p in (tmp_path / "out").iterdir()} >= {"report.md", "bit-plan-1.png", "bit-plan-2.png"}
    assert_png(tmp_path / "out" / "bit-plan-2.png")
    default = CliRunner().invoke(bench_app, ["report", str(path)])
    assert default.exit_code == 0 and (tmp_path / f"{path.stem}-report" / "ppl-front.png").exists()
    bad = CliRunner().invoke(bench_app, ["report", str(path), "--plan", str(tmp_path / "nope.json")])
    assert bad.exit_code == 2 and "no such plan" in bad.output
    json.loads(path.read_text())  # the run itself is untouched


@pytest.mark.usefixtures("one_thread")
def test_offline_run_records_kv_usage_for_the_plots(tmp_path):
    model = str(save_tiny_hf(tmp_path / "tiny", max_position_embeddings=256))
    config = OfflineConfig(
        model=model, workload="random", num_prompts=3, input_len=40, output_len=5, peer=False
    )
    run = run_offline(config)
    timeline = run.aggregates["kv_timeline"]
    steps = run.aggregates["mcp2026"]["num_steps"]
    assert len(timeline["t_s"]) == len(timeline["blocks_used"]) == steps
    assert timeline["t_s"] == sorted(timeline["t_s"]) and timeline["num_blocks"] > 0
    # 3 requests of 45 tokens hold 3 blocks each (16-token blocks) at their peak; all are freed at the end.
    assert max(timeline["blocks_used"]) == 9 and timeline["blocks_used"][-1] == 0
    _, figures = write_report([("offline", run)], tmp_path / "rep")
    assert {p.name for _, p in figures.paths} == {"latency-cdf.png", "kv-usage.png"}
    assert_png(tmp_path / "rep" / "kv-usage.png")
