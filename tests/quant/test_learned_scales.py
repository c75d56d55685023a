"""Learned int4 scales: the held-out gate never raises a layer's output error, the learned grid lowers it where
round-to-nearest's grid is poor, on-grid weights keep their levels, the int4 layout and bits stay as they were,
artifacts round-trip, and the ways in (LayerQuantSpec.method, QuantConfig.method, YAML)."""

from __future__ import annotations

import copy

import pytest
import torch

from mcp2026.config import QuantConfig
from mcp2026.loading.loader import load_model
from mcp2026.quant import artifact, learned_scales, recipe
from mcp2026.quant.calibrate import CalibrationSettings
from mcp2026.quant.compile_cli import parse_spec
from mcp2026.quant.int4_linear import Int4Linear
from mcp2026.quant.int4_packing import unpack_int4
from mcp2026.quant.learned_scales import LearnedScaleSettings, learned_module
from mcp2026.quant.plan import LayerQuantSpec, QuantPlan, linear_modules
from mcp2026.quant.quantizer import dequantize_groupwise_int4, fake_quantize, quantize_int4

from conftest import auto_head_under_int4, tiny_random_model

pytestmark = pytest.mark.usefixtures("one_thread")

FORMATS = ("fp32", "int8", "int4")
SYM = LayerQuantSpec("int4", 32, symmetric=True, method="learned")
ASYM = LayerQuantSpec("int4", 32, symmetric=False, method="learned")


def _samples(count: int = 4, length: int = 64) -> list[torch.Tensor]:
    return [torch.randint(320, (length,), generator=torch.Generator().manual_seed(i)) for i in range(count)]


def _rtn(spec: LayerQuantSpec) -> LayerQuantSpec:
    return LayerQuantSpec(**spec.to_dict() | {"method": "rtn"})


def _error(x: torch.Tensor, w: torch.Tensor, q: torch.Tensor) -> float:
    return float((x @ (q - w).T).pow(2).mean())


def _outlier_layer(seed: int = 0) -> tuple[torch.nn.Linear, torch.Tensor, torch.Tensor]:
    """A linear with heavy-tailed weights fed inputs with a few large channels (train rows, held-out rows)."""
    g = torch.Generator().manual_seed(seed)
    linear = torch.nn.Linear(128, 64, bias=False)
    with torch.no_grad():
        w = torch.distributions.StudentT(3.0).sample((64, 128)) * 0.02
        linear.weight.copy_(w)
    channel = torch.ones(128)
    channel[torch.randperm(128, generator=g)[:6]] = 20.0  # activation outliers
    x = torch.randn(768, 128, generator=g) * channel
    return linear, x[:512], x[512:]


@pytest.mark.parametrize("spec", [SYM, ASYM], ids=["sym", "asym"])
def test_learned_grid_lowers_the_output_error_of_a_layer_with_outliers(spec):
    linear, train, heldout = _outlier_layer()
    module, error = learned_module("x", linear, spec, train, heldout, None, LearnedScaleSettings(steps=60))
    w = linear.weight.detach()
    rtn = dequantize_groupwise_int4(*quantize_int4(w, _rtn(spec)), 32)
    kept = module.dequantize().float()
    assert error.kept_learned and error.ratio < 0.97, error
    assert _error(heldout, w, kept) == pytest.approx(error.learned, rel=1e-4)
    assert _error(heldout, w, rtn) == pytest.approx(error.rtn, rel=1e-4)


def test_gate_never_raises_the_measured_output_error():
    """Training rows that stress other input channels than the held-out rows do: the learned grid is then worse
    than round-to-nearest's on the held-out rows for some layers. What a layer stores never is, and where the
    gate refused the learned grid the layer holds rounding's levels."""
    refused = 0
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        linear = _outlier_layer(seed)[0]
        w = linear.weight.detach()
        emphasis = torch.rand(128, generator=g) * 10 + 0.1
        train, heldout = (
            torch.randn(64, 128, generator=g) * emphasis,
            torch.randn(256, 128, generator=g) / emphasis,
        )
        settings = LearnedScaleSettings(steps=40, lr=0.05)
        module, error = learned_module("x", linear, ASYM, train, heldout, None, settings)
        stored = module.dequantize().float()
        rtn = dequantize_groupwise_int4(*quantize_int4(w, _rtn(ASYM)), 32)
        assert _error(heldout, w, stored) <= _error(heldout, w, rtn) * (1 + 1e-6), seed
        learned = dequantize_groupwise_int4(*learned_scales.learn_grid(w, ASYM, train, settings), 32)
        if _error(heldout, w, learned) > _error(heldout, w, rtn):
            refused += 1
            assert not error.kept_learned and torch.equal(stored, rtn), seed
    assert refused, "no layer where the learned grid was worse on held-out rows: the gate was not exercised"


def test_sequential_reports_every_linear_and_keeps_rounding_where_refused():
    model = tiny_random_model()[0]
    rtn = {n: fake_quantize(m.weight, _rtn(ASYM)) for n, m in linear_modules(model)}
    errors = learned_scales.quantize_sequential(model, QuantPlan({"_default": ASYM}), _samples(), None, None,
                                                LearnedScaleSettings(steps=10), progress=False)  # fmt: skip
    assert set(errors) == set(rtn)
    for name, e in errors.items():
        stored = model.get_submodule(name).dequantize().float()
        assert torch.equal(stored, rtn[name]) != e.kept_learned, name  # a kept grid has lower error: it moved
    line = learned_scales.summary(errors)
    assert line.startswith(f"learned scales: {len(errors)} linears") and "held-out" in line
    assert all(name in learned_scales.per_layer(errors) for name in errors)


def test_weights_already_on_the_grid_keep_their_levels():
    """Weights on an asym g32 grid with bf16 scales and zeros: round-to-nearest gives them back exactly (zero
    error), so the gate keeps those levels whatever the learning did."""
    linear, train, heldout = _outlier_layer(1)
    q, scales, zeros = quantize_int4(linear.weight, _rtn(ASYM))
    with torch.no_grad():
        linear.weight.copy_(dequantize_groupwise_int4(q, scales, zeros, 32))
    module, error = learned_module("x", linear, ASYM, train, heldout, None, LearnedScaleSettings(steps=20))
    assert error.rtn == pytest.approx(0.0, abs=1e-12) and not error.kept_learned
    assert torch.equal(unpack_int4(module.weight, 64, 128), q)
    assert torch.equal(module.dequantize().float(), linear.weight)


def test_layout_levels_and_bits_are_round_to_nearest_ones():
    linear, train, heldout = _outlier_layer(2)
    module, error = learned_module(
        "x", linear, SYM, train, heldout, torch.bfloat16, LearnedScaleSettings(steps=30)
    )
    plain = Int4Linear.from_linear(linear, _rtn(SYM), torch.bfloat16)
    assert isinstance(module, Int4Linear) and error.kept_learned
    assert module.weight.shape == plain.weight.shape and module.weight.dtype == torch.uint8
    assert module.scales_and_zeros.shape == plain.scales_and_zeros.shape
    assert module.bits_per_weight == plain.bits_per_weight
    levels = unpack_int4(module.weight, 64, 128)
    assert int(levels.min()) >= 0 and int(levels.max()) <= 15
    assert not torch.equal(levels, unpack_int4(plain.weight, 64, 128))  # the learned grid moved some levels
    x = heldout[:5].float()
    torch.testing.assert_close(module(x).float(), x @ module.dequantize().float().T, rtol=0.05, atol=0.05)


def test_quant_config_method_learned_round_trips_through_an_artifact(tmp_path, monkeypatch):
    from conftest import save_tiny_hf

    monkeypatch.setattr(recipe, "hardware_candidates", lambda device="cpu": (FORMATS, {}))
    loaded = load_model(save_tiny_hf(tmp_path / "src"))
    config = QuantConfig(target_precision="int4", method="learned", calibration_source="random")
    calibration = CalibrationSettings(source="random", num_samples=4, max_len=64)
    result = recipe.quantize_model(
        loaded.model, None, config, calibration=calibration,
        learned_settings=LearnedScaleSettings(steps=5), progress=False,
    )  # fmt: skip
    specs = {n: m.spec for n, m in linear_modules(loaded.model)}
    assert specs.pop("lm_head") == auto_head_under_int4()
    assert set(specs.values()) == {LayerQuantSpec("int4", 32, method="learned")}
    assert (
        result.notes[0].startswith("learned scales: 8 linears")
        and "layers.0.attn.qkv_proj" in result.notes[1]
    )
    assert "learned scales" in result.plan.spec_for("layers.0.attn.o_proj").describe()
    ids = torch.randint(320, (24,))
    expected = loaded.model.compute_logits(loaded.model(ids, torch.arange(24)))
    out = artifact.save_artifact(tmp_path / "art", loaded, result, config)
    again = load_model(out).model
    assert torch.equal(again.compute_logits(again(ids, torch.arange(24))), expected)
    assert artifact.read_metadata(out)["calibration"]["num_samples"] == 4


def test_ways_in_and_refusals():
    spec = parse_spec({"target_precision": "int4", "method": "learned", "learned": {"steps": 7, "lr": 0.02}})
    assert spec.quant.method == "learned" and spec.learned == LearnedScaleSettings(steps=7, lr=0.02)
    with pytest.raises(ValueError, match="unknown keys in 'learned'"):
        parse_spec({"learned": {"step": 7}})
    with pytest.raises(ValueError, match="learned.heldout_share must be in"):
        LearnedScaleSettings(heldout_share=1.0)
    with pytest.raises(ValueError, match="method 'learned' applies to plain int4 layers"):
        LayerQuantSpec("int8", method="learned")
    with pytest.raises(ValueError, match="learned levels depend on the layer's calibration inputs"):
        fake_quantize(torch.randn(16, 32), SYM)
    with pytest.raises(ValueError, match="pressure plan"):
        QuantConfig(enable_dqg=True, bits_budget=6, pressure_bits_budget=4.5, method="learned")
    with pytest.raises(ValueError, match=">= 2 calibration samples"):
        learned_scales.quantize_sequential(
            copy.deepcopy(tiny_random_model()[0]), QuantPlan({"_default": SYM}), _samples(1), progress=False
        )
