"""The quant YAML's spec: QuantConfig plus typed calibration / dqg sections, one-line errors per key."""

from __future__ import annotations

import dataclasses

import pytest

from mcp2026.config import QuantConfig
from mcp2026.quant.calibrate import CalibrationSettings
from mcp2026.quant.compile_cli import CompileSpec, load_spec, parse_spec


def test_from_config_is_the_spec_of_the_flat_keys():
    flat = {"enable_dqg": True, "symmetric": True, "calibration_source": "random", "calibration_samples": 3}
    spec = CompileSpec.from_config(QuantConfig(**flat))
    assert spec == parse_spec(flat)
    assert spec.calibration == CalibrationSettings(source="random", num_samples=3) and spec.dqg.symmetric_only


def test_sections_are_typed_and_override_the_flat_keys():
    spec = parse_spec({
        "calibration_samples": 5,
        "calibration": {"num_samples": 2, "seed": 7, "source": "random"},
        "dqg": {"awq_alphas": [0, 0.5], "analytic_kld": 1, "symmetric_only": True},
    })  # fmt: skip
    assert spec.calibration == CalibrationSettings("random", 2, seed=7)
    assert spec.dqg.awq_alphas == (0, 0.5) and spec.dqg.analytic_kld == 1 and spec.dqg.symmetric_only
    assert parse_spec({"dqg": None, "calibration": None}) == parse_spec({})  # an empty section: defaults


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"dqg": {"weightin": "relative"}}, "unknown keys in 'dqg': ['weightin']; known: ["),
        ({"dqg": ["weighting"]}, "'dqg' must be a mapping, got list"),
        ({"dqg": {"weighting": "kld"}}, "dqg.weighting must be one of"),
        ({"dqg": {"symmetric_only": "yes"}}, "dqg.symmetric_only must be bool, got 'yes'"),
        ({"dqg": {"awq_alphas": 0.5}}, "dqg.awq_alphas must be a list of numbers, got 0.5"),
        ({"calibration": {"max_len": 1}}, "calibration.max_len must be >= 2, got 1"),
        ({"calibration": {"fisher_samples": True}}, "calibration.fisher_samples must be int, got True"),
        ({"calibration": {"source": 3}}, "calibration.source must be str, got 3"),
        ({"calibration": {"ema_decay": 1}}, "calibration.ema_decay must be in (0, 1)"),
        ({"calibration": {"ema_decay": 0.0}}, "calibration.ema_decay must be in (0, 1)"),
        ({"calibration": {"ema_decay": "fast"}}, "calibration.ema_decay must be float, got 'fast'"),
        ({"calibration": {"ema": 0.9}}, "unknown keys in 'calibration': ['ema']"),
    ],
)
def test_bad_section_names_file_and_key_once(tmp_path, data, message):
    import yaml

    path = tmp_path / "q.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError) as caught:
        load_spec(path)
    text = str(caught.value)
    assert text.startswith(f"{path}: ") and message in text
    assert text.count(str(path)) == 1 and "\n" not in text


def test_ema_decay_round_trips_through_yaml(tmp_path):
    import yaml

    path = tmp_path / "q.yaml"
    path.write_text(yaml.safe_dump({"calibration": {"ema_decay": 0.95, "num_samples": 4}}))
    spec = load_spec(path)
    assert spec.calibration.ema_decay == 0.95 and spec.calibration.num_samples == 4
    path.write_text(yaml.safe_dump({"calibration": dataclasses.asdict(spec.calibration)}))
    assert load_spec(path).calibration == spec.calibration
    assert parse_spec({}).calibration.ema_decay == 0.999  # the default
