"""``mcp2026 canary`` on the real default model (SmolLM2-135M): fp32 against int8 weights, a minimal run.
bf16 activations would be the issue's pair, but bf16 compute is slow on CPUs without AVX512-BF16/AMX, so
the baseline is fp32 (the configs' ``dtype`` is a YAML field: examples/canary/bf16.yaml)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from mcp2026.canary.gate import EXIT_CODES, verdict_of
from mcp2026.cli import app

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


def test_default_model_fp32_vs_int8(tmp_path):
    from mcp2026.bench.report import project_root

    examples = project_root() / "examples" / "canary"
    args = [
        "canary", "--no-progress", "--baseline", examples / "fp32.yaml", "--candidate", examples / "int8.yaml",
        "--workload", "random", "--num-prompts", "4", "--block-size", "2", "--input-len", "16",
        "--max-tokens", "4", "--eval-windows", "1", "--eval-ctx", "64", "--out", tmp_path,
    ]  # fmt: skip
    result = CliRunner().invoke(app, [str(a) for a in args])
    (json_path,) = tmp_path.glob("*-canary.json")
    report = json.loads(json_path.read_text())
    assert (
        result.exit_code
        == report["exit_code"]
        == EXIT_CODES[verdict_of(m["status"] for m in report["metrics"])]
    )
    # 4 requests per arm cannot decide latency: the verdict holds, whatever the machine's noise
    assert result.exit_code == 1
    latency = [m for m in report["metrics"] if m["kind"] == "latency"]
    assert all(m["reason"] == "not enough samples (4 < 20)" for m in latency)
    arms = report["arms"]
    assert arms["candidate"]["quant"]["target_precision"] == "int8" and arms["baseline"]["quant"] is None
    assert (
        arms["candidate"]["weight_bytes_per_decode_step"] < arms["baseline"]["weight_bytes_per_decode_step"]
    )
    acc = report["accuracy"]
    assert acc["num_tokens"] == 31 and acc["kld"] > 0  # int8 weights are not bit-exact
    assert 5 < acc["baseline_ppl"] < 500  # a real model on real text
    assert abs(acc["ppl_change_pct"]) < 20
