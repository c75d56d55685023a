"""QuantGate: two plans, only differing layers held twice, atomic switches between forwards, counted."""

from __future__ import annotations

import copy

import pytest
import torch

from mcp2026.loading.loader import load_model
from mcp2026.quant.gate import QuantGate
from mcp2026.quant.int4_linear import Int4Linear
from mcp2026.quant.int8_linear import Int8Linear
from mcp2026.quant.linear import quantize_
from mcp2026.quant.plan import LayerQuantSpec, QuantPlan

DTYPES = {"int8": torch.float32, "int4": torch.float32}
QUALITY = QuantPlan.uniform("int8")
PRESSURE = QuantPlan({"layers.*.mlp.*": LayerQuantSpec("int4", 32), "_default": "int8"})


pytestmark = pytest.mark.usefixtures("one_thread")


def _logits(model, ids):
    with torch.inference_mode():
        return model.compute_logits(model(ids, torch.arange(len(ids))))


@pytest.fixture
def models(tiny_llama_dir):
    base = load_model(tiny_llama_dir).model
    expected = {
        name: _logits(quantize_(copy.deepcopy(base), plan, compute_dtypes=DTYPES), IDS)
        for name, plan in (("quality", QUALITY), ("pressure", PRESSURE))
    }
    return base, expected


IDS = torch.arange(1, 30)


def test_only_differing_layers_are_held_twice(models):
    base, _ = models
    gate = QuantGate(base, QUALITY, PRESSURE, compute_dtypes=DTYPES)
    assert sorted(gate.differing_layers) == [
        f"layers.{i}.mlp.{p}" for i in (0, 1) for p in ("down_proj", "gate_up_proj")
    ]
    assert isinstance(base.layers[0].attn.qkv_proj, Int8Linear)  # shared: one module, quality installed
    assert isinstance(base.layers[0].mlp.down_proj, Int8Linear)
    assert 0 < gate.extra_bytes < sum(t.numel() * t.element_size() for t in base.state_dict().values())


def test_switch_changes_the_plan_and_is_counted(models):
    base, expected = models
    gate = QuantGate(base, QUALITY, PRESSURE, compute_dtypes=DTYPES)
    assert gate.current == "quality" and gate.num_switches == 0
    assert torch.equal(_logits(base, IDS), expected["quality"])
    assert gate.switch("pressure") and gate.current == "pressure"
    assert isinstance(base.layers[1].mlp.gate_up_proj, Int4Linear)
    assert torch.equal(_logits(base, IDS), expected["pressure"])
    assert not gate.switch("pressure") and gate.num_switches == 1  # no-op switches are not counted
    gate.switch("quality")
    assert torch.equal(_logits(base, IDS), expected["quality"]) and gate.num_switches == 2
    with pytest.raises(ValueError, match="plan must be one of"):
        gate.switch("turbo")


def test_request_applies_at_the_next_forward(models):
    base, expected = models
    gate = QuantGate(base, QUALITY, PRESSURE, compute_dtypes=DTYPES)
    gate.request("pressure")
    assert gate.current == "quality"  # nothing changes mid-step
    assert torch.equal(_logits(base, IDS), expected["pressure"])  # applied before this forward
    assert gate.current == "pressure" and gate.num_switches == 1
    gate.request("quality")
    gate.request("pressure")  # the last request wins; pending requests are not switches
    _logits(base, IDS)
    assert gate.current == "pressure" and gate.num_switches == 1
    gate.close()
    gate.request("quality")
    _logits(base, IDS)
    assert gate.current == "pressure"


def test_pipeline_builds_a_gate_from_a_pressure_budget(tiny_llama_dir):
    from mcp2026.config import QuantConfig
    from mcp2026.pipeline import Pipeline
    from mcp2026.serve.server import pick_gate

    config = QuantConfig(
        enable_dqg=True,
        bits_budget=8.5,
        pressure_bits_budget=4.6,
        calibration_source="random",
        calibration_samples=2,
    )
    pipe = Pipeline(model=tiny_llama_dir, config=config, dtype="fp32")
    assert isinstance(pipe.gate, QuantGate) and pipe.gate.current == "quality"
    quality_bits, pressure_bits = pipe.quant_result.avg_bits, pipe.pressure_result.avg_bits
    assert pressure_bits <= 4.6 < quality_bits <= 8.5
    assert pipe.gate.differing_layers  # the smaller budget changed some layers
    ids = torch.arange(1, 20)
    before = _logits(pipe.loaded.model, ids)
    assert pipe.gate.switch("pressure")
    assert not torch.equal(before, _logits(pipe.loaded.model, ids))
    assert pick_gate("auto", pipe, 0.5) is pipe.gate


def test_pressure_budget_must_be_smaller():
    from mcp2026.config import QuantConfig

    with pytest.raises(ValueError, match="must be below bits_budget"):
        QuantConfig(enable_dqg=True, bits_budget=4.5, pressure_bits_budget=6.0)
    with pytest.raises(ValueError, match="needs enable_dqg=True"):
        QuantConfig(target_precision="int8", pressure_bits_budget=4.5)
