"""Weight distribution: flagged layers are found and listed worst first, figures are cached per model
file, --quick without a cache skips, and a uniform quant YAML with flagged layers warns."""

from __future__ import annotations

import torch
from safetensors.torch import load_file, save_file

from mcp2026.doctor import weights
from mcp2026.doctor.context import DoctorContext
from mcp2026.doctor.model_checks import check_quant_config
from mcp2026.doctor.result import Status
from mcp2026.serve.config import ServeConfig

from conftest import save_tiny_hf

HEAVY = "model.layers.1.mlp.down_proj.weight"


def _heavy_tailed_model(folder):
    """A tiny model whose layer 1 down projection has heavy tails (kurtosis far above 5)."""
    save_tiny_hf(folder)
    state = load_file(folder / "model.safetensors")
    w = torch.randn(state[HEAVY].shape, generator=torch.Generator().manual_seed(1))
    state[HEAVY] = (w**3).contiguous()  # cubed normal: excess kurtosis ~ 33
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_flagged_layers_are_reported_and_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("MCP2026_CACHE_DIR", str(tmp_path / "cache"))
    model = _heavy_tailed_model(tmp_path / "m")
    result = weights.check_weight_distribution(DoctorContext(model=model, quick=True))
    assert result.status is Status.SKIP and "--quick" in result.reason
    result = weights.check_weight_distribution(DoctorContext(model=model))
    assert result.status is Status.PASS
    assert result.details["num_layers"] == 2 * 4 + 1  # qkv, o, gate_up, down per layer + lm_head
    assert list(result.details["flagged"])[0] == "layers.1.mlp.down_proj"
    assert result.details["flagged"]["layers.1.mlp.down_proj"]["kurtosis"] > 20
    assert "layers.1.mlp.down_proj" in result.reason

    def never(path):
        raise AssertionError("measured again despite the cache")

    monkeypatch.setattr(weights, "measure_layer_stats", never)
    cached = weights.check_weight_distribution(DoctorContext(model=model, quick=True))
    assert cached.status is Status.PASS and cached.details == result.details


def test_uniform_quantization_without_precompensation_warns(monkeypatch, tmp_path):
    monkeypatch.setenv("MCP2026_CACHE_DIR", str(tmp_path / "cache"))
    model = _heavy_tailed_model(tmp_path / "m")
    uniform, dqg = tmp_path / "w4.yaml", tmp_path / "dqg.yaml"
    uniform.write_text("target_precision: int4\n")
    dqg.write_text("enable_dqg: true\nbits_budget: 4.5\n")
    result = weights.check_weight_distribution(DoctorContext(ServeConfig(quant=str(uniform)), model=model))
    assert result.status is Status.WARN and "without pre-compensation" in result.reason
    assert "enable_dqg" in result.fix
    result = weights.check_weight_distribution(DoctorContext(ServeConfig(quant=str(dqg)), model=model))
    assert result.status is Status.PASS


def test_quant_config_check(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("target_precision: int3\n")
    result = check_quant_config(DoctorContext(ServeConfig(quant=str(bad))))
    assert result.status is Status.FAIL and "int3" in result.reason
    assert check_quant_config(DoctorContext()).status is Status.SKIP
