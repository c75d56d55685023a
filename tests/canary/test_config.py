"""The ``canary:`` section of a serve YAML, the thresholds file and how the arms' overrides merge."""

from __future__ import annotations

from pathlib import Path

import pytest

from mcp2026.bench.canary_run import merged_thresholds
from mcp2026.canary.config import CanaryConfig, read_thresholds_file
from mcp2026.serve.config import load_serve_yaml


def write(path, text):
    path.write_text(text)
    return path


def test_serve_yaml_canary_section(tmp_path):
    (tmp_path / "sub").mkdir()
    path = write(
        tmp_path / "sub" / "serve.yaml",
        "dtype: fp32\ncanary:\n  latency_safe_ms: 5\n  candidate: int8.yaml\n  candidate_share: 0.25\n",
    )
    serve, _ = load_serve_yaml(path)
    canary = serve.canary
    assert canary.candidate == str(tmp_path / "sub" / "int8.yaml")  # relative to the YAML
    assert canary.candidate_share == 0.25
    assert canary.thresholds.latency_safe_ms == 5.0
    assert canary.thresholds.latency_trip_ms == 30.0  # the rest keep the design notes' defaults
    assert load_serve_yaml(write(tmp_path / "plain.yaml", "dtype: fp32\n"))[0].canary == CanaryConfig()


@pytest.mark.parametrize(
    ("section", "phrase"),
    [
        ("  latency_safe: 5\n", "unknown canary keys ['latency_safe']"),
        ("  candidate_share: 1.5\n", "canary.candidate_share must be in (0, 1)"),
        ("  latency_safe_ms: 50\n", "latency_safe_ms (50.0) must be below latency_trip_ms"),
        ("  window: 0\n", "canary.window must be >= 1"),
    ],
)
def test_bad_canary_section(tmp_path, section, phrase):
    path = write(tmp_path / "serve.yaml", "canary:\n" + section)
    with pytest.raises(ValueError) as e:
        load_serve_yaml(path)
    assert phrase in str(e.value)
    assert "\n" not in str(e.value)


def test_thresholds_merge_baseline_then_candidate_then_file(tmp_path):
    a = write(tmp_path / "a.yaml", "canary:\n  latency_safe_ms: 5\n  min_samples: 10\n")
    b = write(tmp_path / "b.yaml", "canary:\n  latency_safe_ms: 7\n")
    f = write(tmp_path / "t.yaml", "canary:\n  min_samples: 30\n")
    configs = [load_serve_yaml(a), load_serve_yaml(b)]
    t = merged_thresholds(configs, None)
    assert (t.latency_safe_ms, t.min_samples) == (7.0, 10)
    t = merged_thresholds(configs, str(f))
    assert (t.latency_safe_ms, t.min_samples) == (7.0, 30)


def test_thresholds_file(tmp_path):
    assert read_thresholds_file(write(tmp_path / "t.yaml", "bandwidth_safe_pct: 60\n")) == {
        "bandwidth_safe_pct": 60
    }
    with pytest.raises(ValueError, match="unknown threshold keys"):
        read_thresholds_file(write(tmp_path / "bad.yaml", "bandwith_safe_pct: 60\n"))
    with pytest.raises(ValueError, match="must be a mapping"):
        read_thresholds_file(write(tmp_path / "list.yaml", "- 1\n"))
    with pytest.raises(FileNotFoundError, match="thresholds file not found"):
        read_thresholds_file(tmp_path / "missing.yaml")


def test_live_options_over_the_yaml():
    base = CanaryConfig.from_mapping({"candidate_share": 0.3})
    assert base.with_live_options("b.yaml", None).candidate == "b.yaml"
    assert base.with_live_options("b.yaml", 0.5).candidate_share == 0.5
    with pytest.raises(ValueError, match="--candidate-share needs a candidate"):
        base.with_live_options(None, 0.5)


def test_ramp_starts_the_share_at_its_first_step(tmp_path):
    path = write(tmp_path / "serve.yaml", "canary:\n  ramp: [0.05, 0.5, 1]\n  evaluate_every_s: 30\n")
    canary = load_serve_yaml(path)[0].canary
    assert canary.ramp == (0.05, 0.5, 1.0)
    assert (canary.candidate_share, canary.evaluate_every_s) == (0.05, 30)
    assert CanaryConfig().ramp == () and CanaryConfig().candidate_share == 0.1  # no ramp: a fixed share
    same = CanaryConfig.from_mapping({"ramp": [0.2, 1.0], "candidate_share": 0.2})
    assert same.with_live_options("b.yaml", None).candidate_share == 0.2


@pytest.mark.parametrize(
    ("section", "phrase"),
    [
        ("  ramp: 0.5\n", "canary.ramp must be a list of shares, e.g. [0.1, 0.25, 0.5, 1.0]"),
        ("  ramp: [0.1, high, 1.0]\n", "canary.ramp must hold numbers (shares of tenants), got 'high'"),
        ("  ramp: [0.1, true]\n", "canary.ramp must hold numbers"),
        ("  ramp: [0.5]\n", "canary.ramp needs a first share and at least one step after it"),
        ("  ramp: [0.1, 0.5, 0.5, 1.0]\n", "canary.ramp must increase step by step"),
        ("  ramp: [0, 0.5, 1.0]\n", "canary.ramp must start in (0, 1), got 0.0"),
        ("  ramp: [0.1, 0.5]\n", "canary.ramp must end at 1.0"),
        ("  ramp: [0.1, 1.5]\n", "canary.ramp must end at 1.0"),
        ("  ramp: [0.1, 1.0]\n  candidate_share: 0.3\n", "with a ramp the share starts at canary.ramp[0]"),
        ("  candidate_share: fast\n", "canary.candidate_share must be a number in (0, 1), got 'fast'"),
        ("  evaluate_every_s: 0\n", "canary.evaluate_every_s must be a number of seconds > 0, got 0"),
        ("  evaluate_every_s: soon\n", "canary.evaluate_every_s must be a number of seconds > 0"),
    ],
)
def test_bad_ramp(tmp_path, section, phrase):
    path = write(tmp_path / "serve.yaml", "canary:\n" + section)
    with pytest.raises(ValueError) as e:
        load_serve_yaml(path)
    assert phrase in str(e.value)
    assert "\n" not in str(e.value)


def test_candidate_share_option_against_a_ramp():
    ramped = CanaryConfig.from_mapping({"ramp": [0.1, 1.0]})
    with pytest.raises(ValueError, match=r"drop candidate_share \(and --candidate-share\)"):
        ramped.with_live_options("b.yaml", 0.5)


def test_the_live_ramp_example_loads():
    example = Path(__file__).resolve().parents[2] / "examples" / "canary" / "live_ramp.yaml"
    canary = load_serve_yaml(example)[0].canary
    assert canary.ramp == (0.1, 0.25, 0.5, 1.0) and canary.candidate_share == 0.1
    assert Path(canary.candidate) == example.parent / "int8.yaml" and Path(canary.candidate).is_file()
