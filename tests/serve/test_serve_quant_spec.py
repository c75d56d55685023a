"""`mcp2026 serve --quant q.yaml` (and a serve YAML's `quant:`) quantizes with the whole quant YAML, its
`calibration:` and `dqg:` sections included: the served plan is the plan `mcp2026 compile` writes."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from mcp2026.cli import app
from mcp2026.compiler import compile_model
from mcp2026.config import KVConfig
from mcp2026.pipeline import Pipeline
from mcp2026.quant import dqg, recipe
from mcp2026.quant.compile_cli import load_spec
from mcp2026.quant.plan import QuantPlan
from mcp2026.serve.config import load_quant_spec, load_serve_yaml
from mcp2026.serve.server import build_pipeline

FORMATS = ("fp32", "int8", "int4")
SMALL_KV = KVConfig(num_blocks=16)
DTYPES = {"int8": torch.float32, "int4": torch.float32}
# The flat keys alone: what serving used before it read the sections (random text, 2 samples).
BASE = "enable_dqg: true\nbits_budget: 5.0\ncalibration_source: random\ncalibration_samples: 2\n"

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def fixed_candidates(monkeypatch):
    """The plan must not depend on this machine's (or its load's) candidate formats."""
    monkeypatch.setattr(recipe, "hardware_candidates", lambda device="cpu": (FORMATS, dict(DTYPES)))


def _serve_yaml(tmp_path, model_dir, quant_text: str):
    (tmp_path / "q.yaml").write_text(quant_text)
    path = tmp_path / "serve.yaml"
    path.write_text(
        f"model: {model_dir}\ndtype: fp32\nquant: q.yaml\nwarmup: false\nkv: {{num_blocks: 16}}\n"
    )
    return path


@pytest.fixture
def used_settings(monkeypatch):
    """The CalibrationSettings and DQGSettings each quantization measured with, in order."""
    seen: list[object] = []
    calibrate, measure = recipe.calibrate, dqg.measure_options

    def spy_calibrate(model, samples, settings, progress=True):
        seen.append(settings)
        return calibrate(model, samples, settings, progress)

    def spy_measure(model, calib, formats, settings, progress=True):
        seen.append(settings)
        return measure(model, calib, formats, settings, progress)

    monkeypatch.setattr(recipe, "calibrate", spy_calibrate)
    monkeypatch.setattr(dqg, "measure_options", spy_measure)
    return seen


@pytest.mark.parametrize(
    ("section", "changes_plan"),
    [
        ("dqg:\n  symmetric_only: true\n  weighting: relative\n", True),
        # Other random text, shorter rows: other measurements, not always another plan (None: not checked).
        ("calibration:\n  seed: 1\n  max_len: 64\n  max_rows: 64\n", None),
        ("pressure_bits_budget: 4.5\ndqg:\n  symmetric_only: true\n", True),  # the gate's quality plan
    ],
    ids=["dqg", "calibration", "pressure"],
)
def test_served_plan_is_the_compiled_plan(tmp_path, tiny_llama_dir, used_settings, section, changes_plan):
    serve, engine = load_serve_yaml(_serve_yaml(tmp_path, tiny_llama_dir, BASE + section))
    spec = load_spec(tmp_path / "q.yaml")
    pipe = build_pipeline(serve, engine)
    assert pipe.quant_spec == spec == load_quant_spec(serve.quant)
    assert (pipe.gate is not None) == ("pressure" in section)
    served = list(used_settings)
    assert served == [spec.calibration, spec.dqg]

    used_settings.clear()
    out = compile_model(tiny_llama_dir, tmp_path / "q.yaml", tmp_path / "art", progress=False)
    compiled = QuantPlan.from_json((out / "plan.json").read_text())
    assert pipe.quant_result.plan == compiled and used_settings == served

    used_settings.clear()  # what serving did before it read the sections: the flat keys only
    flat = Pipeline(model=tiny_llama_dir, config=spec.quant, dtype="fp32", kv_config=SMALL_KV)
    assert used_settings != served
    if changes_plan is not None:
        assert (flat.quant_result.plan != compiled) == changes_plan


def test_quant_config_and_its_default_spec_choose_the_same_plan(tmp_path, tiny_llama_dir):
    """``Pipeline(config=QuantConfig(...))`` keeps its meaning: the settings of a YAML without sections."""
    (tmp_path / "q.yaml").write_text(BASE)
    spec = load_spec(tmp_path / "q.yaml")
    plain = Pipeline(model=tiny_llama_dir, config=spec.quant, dtype="fp32", kv_config=SMALL_KV)
    assert plain.quant_spec == spec and plain.quant_config == spec.quant
    from_spec = Pipeline(model=tiny_llama_dir, config=spec, dtype="fp32", kv_config=SMALL_KV)
    assert from_spec.quant_config == spec.quant and from_spec.quant_result.plan == plain.quant_result.plan
    with pytest.raises(TypeError, match="QuantConfig or a CompileSpec"):
        Pipeline(model=tiny_llama_dir, config={"target_precision": "int8"})


def test_canary_arm_reports_the_yaml_settings(tmp_path, tiny_llama_dir):
    from mcp2026.bench.canary_arms import build_arm

    arm = build_arm(
        "candidate", _serve_yaml(tmp_path, tiny_llama_dir, BASE + "dqg:\n  weighting: relative\n")
    )
    quant = arm.describe()["quant"]
    assert quant["dqg"]["weighting"] == "relative" and quant["calibration"]["num_samples"] == 2
    assert quant["bits_budget"] == 5.0 and quant["yaml"] == str(tmp_path / "q.yaml")


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ("dqg:\n  weightin: relative\n", "unknown keys in 'dqg': ['weightin']"),
        ("calibration:\n  num_samples: 0\n", "calibration.num_samples must be >= 1, got 0"),
        ("calibration:\n  seed: one\n", "calibration.seed must be int, got 'one'"),
        ("dqg:\n  ppl_iterations: 2.5\n", "dqg.ppl_iterations must be int, got 2.5"),
    ],
)
def test_bad_section_is_one_line_naming_file_and_key(tmp_path, tiny_llama_dir, section, message):
    from mcp2026.serve.canary import read_arm_config

    serve_yaml = _serve_yaml(tmp_path, tiny_llama_dir, BASE + section)
    quant_yaml = str(tmp_path / "q.yaml")
    with pytest.raises(ValueError) as caught:
        read_arm_config(serve_yaml)  # a canary arm checks before loading any model
    assert str(caught.value).startswith(f"{quant_yaml}: ") and message in str(caught.value)
    result = CliRunner().invoke(app, ["serve", "--config", str(serve_yaml)])  # fails before the model loads
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [f"error: {caught.value}"]
