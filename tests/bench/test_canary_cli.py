"""``mcp2026 canary`` end to end on a tiny random model (fp32 vs int8, and a config against itself): the
report files, the verdict and the exit code agree with the JSON metrics; bad input exits 3."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mcp2026.canary.gate import EXIT_CODES, verdict_of
from mcp2026.cli import app

pytestmark = pytest.mark.usefixtures("one_thread")
WORKLOAD = ["--workload", "random", "--num-prompts", "20", "--input-len", "16", "--max-tokens", "8"]
EVAL = ["--eval-windows", "12", "--eval-ctx", "128"]  # 12 x 63 scored tokens = 24 blocks of <= 32


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> Path:
    """A tiny random Llama with the SmolLM2 vocabulary and tokenizer (held-out text needs one)."""
    from mcp2026.loading.loader import default_model_path
    from mcp2026.loading.tokenizer import Tokenizer

    from conftest import save_tiny_hf

    root = tmp_path_factory.mktemp("canary")
    save_tiny_hf(root / "tiny", vocab_size=49152, max_position_embeddings=512)
    Tokenizer.from_gguf(default_model_path()).backend.save(str(root / "tiny" / "tokenizer.json"))
    (root / "w8.yaml").write_text("target_precision: int8\ngranularity: per_channel\n")
    common = "model: tiny\ndtype: fp32\nkv: {num_blocks: 64}\n"
    (root / "fp32.yaml").write_text(common)
    (root / "int8.yaml").write_text(common + "quant: w8.yaml\n")
    # Latency noise and the bandwidth estimate of a model that fits the CPU caches are waved through.
    loose = "".join(
        f"{k}: {v}\n"
        for k, v in [
            ("latency_safe_ms", 10**6),
            ("latency_trip_ms", 2 * 10**6),
            ("bandwidth_safe_pct", 10**6),
            ("bandwidth_trip_pct", 2 * 10**6),
        ]
    )
    (root / "loose.yaml").write_text(loose)
    return root


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["canary", "--no-progress", *map(str, args)])
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output


def read_report(out: Path) -> tuple[dict, str]:
    (json_path,) = out.glob("*-canary.json")
    return json.loads(json_path.read_text()), json_path.with_suffix(".md").read_text()


def check_consistent(code: int, report: dict, markdown: str) -> None:
    statuses = [m["status"] for m in report["metrics"]]
    assert report["verdict"] == verdict_of(statuses)
    assert code == report["exit_code"] == EXIT_CODES[report["verdict"]]
    assert markdown.startswith(f"# Canary: {report['verdict']} (exit {code})")
    for m in report["metrics"]:
        assert f"**{m['status']}**" in markdown and m["reason"] in markdown


def test_fp32_vs_int8(configs, tmp_path):
    code, output = run(
        "--baseline", configs / "fp32.yaml", "--candidate", configs / "int8.yaml", *WORKLOAD, *EVAL,
        "--out", tmp_path,
    )  # fmt: skip
    report, markdown = read_report(tmp_path)
    check_consistent(code, report, markdown)
    assert markdown.splitlines()[0] in output  # the report is printed too
    metrics = {m["name"]: m for m in report["metrics"]}
    assert set(metrics) == {"p99_ttft_change", "p99_e2e_change", "ppl_change", "bandwidth_utilisation"}
    records = report["records"]
    assert (
        [r["arm"] for r in records].count("baseline") == [r["arm"] for r in records].count("candidate") == 20
    )
    assert all(r["num_output_tokens"] == 8 and r["finish_reason"] == "length" for r in records)
    assert metrics["p99_e2e_change"]["num_samples"] == 20
    assert report["block_order"] == ["A0", "B0", "B1", "A1", "A2", "B2", "B3", "A3", "A4", "B4"]
    # P99s of each arm as reported, and the change is their difference
    lat = report["latency"]
    assert metrics["p99_e2e_change"]["value"] == pytest.approx(
        lat["candidate"]["p99_e2e_ms"] - lat["baseline"]["p99_e2e_ms"]
    )
    m = metrics["p99_ttft_change"]
    assert m["low"] <= m["value"] <= m["high"]
    # accuracy: int8 weights change the perplexity a little, through the engines' paged path
    acc = report["accuracy"]
    assert acc["num_windows"] == 12 and acc["num_tokens"] == 12 * 63 and acc["num_blocks"] == 24
    assert metrics["ppl_change"]["value"] == pytest.approx(
        100 * (1 - acc["candidate_ppl"] / acc["baseline_ppl"])
    )
    assert acc["kld"] > 0 and 0 < acc["top1_agreement"] <= 1
    # bandwidth: the gated value is the candidate's estimate, int8 weights move fewer bytes per step
    bw = report["bandwidth"]
    cand = bw["candidate"]
    moved = (
        cand["decode_steps"] * cand["weight_bytes_per_step"]
        + cand["decode_context_tokens"] * cand["kv_bytes_per_token"]
    )
    assert cand["bytes_moved"] == pytest.approx(moved)
    assert metrics["bandwidth_utilisation"]["value"] == pytest.approx(
        100 * moved / cand["decode_seconds"] / cand["peak_bytes_per_s"]
    )
    assert cand["weight_bytes_per_step"] < bw["baseline"]["weight_bytes_per_step"]
    assert report["arms"]["candidate"]["quant"]["target_precision"] == "int8"
    assert 0 <= report["greedy_agreement"]["identical_share"] <= 1


def test_a_config_against_itself_promotes_with_loose_latency(configs, tmp_path):
    # Same weights, same batches: identical outputs and perplexity.
    code, _ = run(
        "--baseline", configs / "fp32.yaml", "--candidate", configs / "fp32.yaml", *WORKLOAD, *EVAL,
        "--thresholds", configs / "loose.yaml", "--out", tmp_path,
    )  # fmt: skip
    report, markdown = read_report(tmp_path)
    check_consistent(code, report, markdown)
    assert report["accuracy"]["ppl_change_pct"] == pytest.approx(0.0, abs=1e-9)
    assert report["accuracy"]["kld"] == pytest.approx(0.0, abs=1e-9)
    assert report["greedy_agreement"]["identical_share"] == 1.0
    assert report["thresholds"]["latency_safe_ms"] == 1e6
    assert code == 0 and report["verdict"] == "PROMOTE"


def test_too_few_requests_hold(configs, tmp_path):
    code, _ = run(
        "--baseline", configs / "fp32.yaml", "--candidate", configs / "fp32.yaml", "--workload", "random",
        "--num-prompts", "6", "--input-len", "8", "--max-tokens", "2", "--eval-windows", "0",
        "--thresholds", configs / "loose.yaml", "--out", tmp_path,
    )  # fmt: skip
    report, markdown = read_report(tmp_path)
    check_consistent(code, report, markdown)
    reasons = {m["name"]: m["reason"] for m in report["metrics"]}
    assert reasons["p99_ttft_change"] == "not enough samples (6 < 20)"
    assert reasons["ppl_change"] == "not measured (--eval-windows 0)"
    assert code == 1


@pytest.mark.parametrize(
    ("args", "phrase"),
    [
        (
            ["--baseline", "missing.yaml", "--candidate", "missing.yaml"],
            "missing.yaml: no such configuration file",
        ),
        (["--candidate", "x.yaml"], "give --baseline A.yaml and --candidate B.yaml"),
        (
            ["--baseline", "{c}/fp32.yaml", "--candidate", "{c}/fp32.yaml", "--num-prompts", "0"],
            "--num-prompts must be >= 1",
        ),
        (
            ["--baseline", "{c}/fp32.yaml", "--candidate", "{c}/fp32.yaml", "--thresholds", "{c}/w8.yaml"],
            "unknown threshold keys",
        ),
        (
            ["--baseline", "{c}/fp32.yaml", "--candidate", "{c}/fp32.yaml", "--workload", "long"],
            "--workload must be sharegpt or random",
        ),
        (["--num-prompts", "many"], "--num-prompts"),  # typer parses options: its usage error, exit 3 too
    ],
)
def test_bad_input_exits_3_with_one_line(configs, args, phrase):
    code, output = run(*(a.format(c=configs) for a in args))
    assert code == 3, output
    assert phrase in output
