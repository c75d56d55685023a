"""Quantization plans for mixture-of-experts models: every expert's linears are planned, those the calibration
never reached (an expert the router did not pick on the calibration text) included."""

from __future__ import annotations

import pytest
import torch

from mcp2026.config import ModelConfig, QuantConfig
from mcp2026.models.registry import build_model
from mcp2026.quant import recipe
from mcp2026.quant.calibrate import CalibrationSettings
from mcp2026.quant.int4_linear import Int4Linear
from mcp2026.quant.quant_linear import QuantLinear

FORMATS = ("fp32", "int8", "int4")
FP32_KERNELS = {"int8": torch.float32, "int4": torch.float32}
CALIB = CalibrationSettings(source="random", num_samples=4, max_len=64, max_rows=128, fisher_samples=0)

pytestmark = pytest.mark.usefixtures("one_thread")


def _moe_model_that_never_picks_expert_3():
    """One expert per token; routers whose rows 0 and 1 are v and -v and row 3 is 0: one of the first two always
    scores above expert 3, so no token reaches it."""
    config = ModelConfig(architecture="MixtralForCausalLM", vocab_size=320, hidden_size=64, intermediate_size=64,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, num_experts=4,
                         num_experts_per_tok=1)  # fmt: skip
    torch.manual_seed(0)
    model = build_model(config).eval().requires_grad_(False)
    for layer in model.layers:
        v = torch.randn(64)
        layer.mlp.router.weight.copy_(torch.stack([v, -v, torch.randn(64), torch.zeros(64)]))
    return model


def test_experts_no_calibration_token_reached_get_the_cheapest_format():
    model = _moe_model_that_never_picks_expert_3()
    config = QuantConfig(
        enable_dqg=True, bits_budget=6.0, method="rtn", calibration_source="random", calibration_samples=4
    )
    result = recipe.plan_for_config(model, None, config, formats=FORMATS, calibration=CALIB, progress=False)
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    unreached = {f"layers.{i}.mlp.experts.3.{p}" for i in range(2) for p in ("gate_up_proj", "down_proj")}
    assert set(result.layers) == linears - unreached  # every other expert was measured
    assert all(result.plan.spec_for(n).format == "int4" for n in unreached)
    assert any("4 linears no calibration token reached" in note for note in result.notes)
    recipe.apply(model, result, FP32_KERNELS, progress=False)
    assert all(isinstance(model.get_submodule(n), Int4Linear) for n in unreached)
    assert all(isinstance(model.get_submodule(n), QuantLinear) for n in linears)  # router: not a linear
    assert model.layers[0].mlp.router.weight.dtype == torch.float32
    with torch.no_grad():
        assert torch.isfinite(model.compute_logits(model(torch.arange(3, 19), torch.arange(16)))).all()
