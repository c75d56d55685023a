"""GPTQ: lower output error than round-to-nearest on every linear, the same int4 layout (the kernels run it),
sequential layer order, determinism, and the ways in (LayerQuantSpec.method, QuantConfig.method, YAML)."""

from __future__ import annotations

import copy

import pytest
import torch

from mcp2026.config import QuantConfig
from mcp2026.quant import gptq, recipe
from mcp2026.quant.calibrate import CalibrationSettings
from mcp2026.quant.compile_cli import parse_spec
from mcp2026.quant.int4_linear import Int4Linear
from mcp2026.quant.int4_packing import unpack_int4
from mcp2026.quant.int8_linear import Int8Linear
from mcp2026.quant.linear import build_linear
from mcp2026.quant.plan import LayerQuantSpec, QuantPlan, linear_modules
from mcp2026.quant.quantizer import correction_bias, dequantize_groupwise_int4, fake_quantize, quantize_int4
from mcp2026.quant.split_rows_linear import SplitRowsLinear

from conftest import auto_head_under_int4, tiny_random_model

pytestmark = pytest.mark.usefixtures("one_thread")

FORMATS = ("fp32", "int8", "int4")
SPECS = [
    LayerQuantSpec("int4", 32, symmetric=True, method="gptq"),
    LayerQuantSpec("int4", 64, symmetric=False, method="gptq"),
    LayerQuantSpec("int4", 32, symmetric=False, clip_ratio="mse", method="gptq"),
]


def _samples(count: int = 4, length: int = 96) -> list[torch.Tensor]:
    return [torch.randint(320, (length,), generator=torch.Generator().manual_seed(i)) for i in range(count)]


@pytest.fixture(scope="module")
def float_inputs():
    """The tiny model and every linear's input rows (T, K) on the calibration samples, unquantized."""
    model = tiny_random_model()[0]
    rows: dict[str, list[torch.Tensor]] = {}
    linears = dict(linear_modules(model))
    hooks = [m.register_forward_pre_hook(lambda _m, a, n=n: rows.setdefault(n, []).append(a[0])) for n, m in linears.items()]  # fmt: skip
    with torch.no_grad():
        for ids in _samples():
            model.compute_logits(model(ids, torch.arange(len(ids))))
    for hook in hooks:
        hook.remove()
    return model, {n: torch.cat(r).float() for n, r in rows.items()}


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.describe())
@pytest.mark.parametrize("act_order", [False, True], ids=["", "act-order"])
def test_gptq_output_error_is_below_round_to_nearest_on_every_linear(float_inputs, spec, act_order):
    model, inputs = float_inputs
    settings = gptq.GPTQSettings(act_order=act_order)
    for name, x in inputs.items():
        w = model.get_submodule(name).weight.detach()
        hessian = 2 * x.T @ x / x.shape[0]
        rtn = dequantize_groupwise_int4(*quantize_int4(w, LayerQuantSpec(**spec.to_dict() | {"method": "rtn"})), spec.group_size)  # fmt: skip
        q, scales, zeros = gptq.gptq_int4(w, hessian, spec, settings)
        ours = dequantize_groupwise_int4(q, scales, zeros, spec.group_size)
        error, rtn_error = (x @ (ours - w).T).pow(2).sum(), (x @ (rtn - w).T).pow(2).sum()
        assert error < 0.95 * rtn_error, (name, (error / rtn_error).item())
        assert gptq.output_error(w, ours, hessian) == pytest.approx(error.item() / x.shape[0], rel=1e-3)


def test_lazy_block_updates_give_what_one_block_gives():
    """Columns past the current block get the block's errors at its end (GPTQ's lazy batches): the same
    arithmetic regrouped, so 128-column blocks give the levels of one 384-column block."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 384, generator=g) @ torch.randn(384, 384, generator=g) / 20  # correlated inputs
    w = torch.randn(48, 384, generator=g)
    hessian = 2 * x.T @ x / len(x)
    spec = LayerQuantSpec("int4", 64, method="gptq")
    blocks = [gptq.gptq_int4(w, hessian, spec, gptq.GPTQSettings(block_size=b)) for b in (128, 384)]
    assert (blocks[0][0] != blocks[1][0]).float().mean() < 0.005
    rtn = dequantize_groupwise_int4(*quantize_int4(w, LayerQuantSpec("int4", 64)), 64)
    errors = [gptq.output_error(w, dequantize_groupwise_int4(*b, 64), hessian) for b in blocks]
    assert errors[0] == pytest.approx(errors[1], rel=0.01) and errors[0] < 0.8 * gptq.output_error(
        w, rtn, hessian
    )


def test_gptq_levels_are_stored_in_the_int4_layout_the_kernels_run(float_inputs):
    model, inputs = float_inputs
    name, spec = "layers.0.mlp.down_proj", SPECS[0]
    linear, x = model.get_submodule(name), inputs[name]
    q, scales, zeros = gptq.gptq_int4(linear.weight, 2 * x.T @ x / len(x), spec)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15
    plain = Int4Linear.from_linear(linear, LayerQuantSpec("int4", 32, symmetric=True), torch.bfloat16)
    module = Int4Linear.from_levels(linear, spec, q, scales, zeros, torch.bfloat16)
    layout = lambda m: {k: (v.shape, v.dtype) for k, v in m.state_dict().items()}  # noqa: E731
    assert layout(module) == layout(plain)
    assert torch.equal(unpack_int4(module.weight, *q.shape), q)
    assert torch.equal(module.dequantize(), dequantize_groupwise_int4(q, scales, zeros, 32))
    for rows in (1, 96):  # decode and prefill kernels
        y = module(x[:rows])
        reference = x[:rows] @ module.dequantize().T
        assert (y - reference).norm() / reference.norm() < 0.02


def test_sequential_layers_see_the_quantized_layers_before_them():
    model = tiny_random_model(num_layers=3)[0]
    plan = QuantPlan({"_default": SPECS[1]})
    whole = copy.deepcopy(model)
    gptq.quantize_sequential(whole, plan, _samples(), progress=False)
    # layers 0 and 1 alone, then layer 2's H measured by whole forward passes of that partly quantized model
    first = copy.deepcopy(model)
    gptq.quantize_sequential(first, QuantPlan({"layers.[01].*": SPECS[1]}), _samples(), progress=False)
    name = "layers.2.attn.qkv_proj"
    linear = first.get_submodule(name)
    total = gptq.HessianAccumulator(linear.in_features)
    hook = linear.register_forward_pre_hook(lambda _m, a: total.add(a[0], len(a[0])))  # the sink's weight
    with torch.no_grad():
        for ids in _samples():
            first(ids, torch.arange(len(ids)))
    hook.remove()
    q = gptq.gptq_int4(linear.weight, total.hessian(), SPECS[1])[0]
    assert torch.equal(unpack_int4(whole.get_submodule(name).weight, *q.shape), q)
    float_hessian = gptq.HessianAccumulator(linear.in_features)
    hook = model.get_submodule(name).register_forward_pre_hook(lambda _m, a: float_hessian.add(a[0]))
    with torch.no_grad():
        for ids in _samples():
            model(ids, torch.arange(len(ids)))
    hook.remove()
    assert not torch.allclose(float_hessian.hessian(), total.hessian())  # the order matters here


def test_gptq_is_deterministic_and_reports_every_linear():
    model = tiny_random_model()[0]
    plan = QuantPlan({"lm_head": "int8", "_default": SPECS[0]})
    runs = []
    for _ in range(2):
        quantized = copy.deepcopy(model)
        errors = gptq.quantize_sequential(quantized, plan, _samples(), progress=False)
        runs.append(quantized.state_dict())
    assert runs[0].keys() == runs[1].keys()
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])
    assert set(errors) == {n for n, m in linear_modules(model) if n != "lm_head"}
    assert all(e.ratio < 1 for e in errors.values()), errors
    assert isinstance(quantized.lm_head, Int8Linear)
    assert "GPTQ: 8 linears" in gptq.summary(errors)


def test_quant_config_method_gptq_quantizes_int4_layers_with_gptq(monkeypatch):
    monkeypatch.setattr(recipe, "hardware_candidates", lambda device="cpu": (FORMATS, {}))
    model = tiny_random_model()[0]
    config = QuantConfig(
        target_precision="int4", method="gptq", calibration_source="random", calibration_samples=2
    )
    calibration = CalibrationSettings(source="random", num_samples=2, max_len=96)
    result = recipe.quantize_model(model, None, config, calibration=calibration, progress=False)
    specs = {n: m.spec for n, m in linear_modules(model)}
    assert specs.pop("lm_head") == auto_head_under_int4()
    assert set(specs.values()) == {LayerQuantSpec("int4", 32, method="gptq")}
    assert any(note.startswith("GPTQ: 8 linears") for note in result.notes)
    assert "GPTQ" in result.plan.spec_for("layers.0.attn.o_proj").describe()


def test_gptq_is_refused_where_it_cannot_apply():
    with pytest.raises(ValueError, match="method 'gptq' applies to int4 layers without act_scale, not int8"):
        LayerQuantSpec("int8", method="gptq")
    with pytest.raises(ValueError, match="method 'gptq' applies to int4 layers without act_scale"):
        LayerQuantSpec("int4", act_scale="s", method="gptq")
    with pytest.raises(ValueError, match="method 'learned' applies to plain int4 layers"):
        LayerQuantSpec("int4", high_rows=0.1, method="learned")
    with pytest.raises(ValueError, match="method must be one of"):
        LayerQuantSpec("int4", method="awq")
    with pytest.raises(ValueError, match="quantize with quant.gptq"):
        fake_quantize(torch.randn(16, 32), SPECS[0])
    with pytest.raises(ValueError, match="build with from_levels"):
        Int4Linear.from_linear(torch.nn.Linear(32, 16), SPECS[0])
    with pytest.raises(ValueError, match="QuantConfig.method must be one of"):
        QuantConfig(method="awq")
    with pytest.raises(ValueError, match="pressure plan"):
        QuantConfig(enable_dqg=True, bits_budget=6, pressure_bits_budget=4.5, method="gptq")
    with pytest.raises(ValueError, match="gptq.block_size must be a multiple of 128"):
        gptq.GPTQSettings(block_size=96)


def test_method_is_read_from_yaml_and_kept_out_of_rtn_plans():
    spec = parse_spec(
        {"target_precision": "int4", "method": "gptq", "gptq": {"damp": 0.05, "act_order": True}}
    )
    assert spec.quant.method == "gptq" and spec.gptq == gptq.GPTQSettings(damp=0.05, act_order=True)
    with pytest.raises(ValueError, match="unknown keys in 'gptq'"):
        parse_spec({"gptq": {"percdamp": 0.1}})
    assert "method" not in LayerQuantSpec("int4").to_dict()  # plan ids from before GPTQ stay as they were
    plan = QuantPlan({"_default": SPECS[0]})
    assert (
        QuantPlan.from_json(plan.to_json()) == plan
        and plan.plan_id != QuantPlan({"_default": "int4"}).plan_id
    )


def test_weights_already_on_a_grid_keep_their_rounded_levels():
    """Weights on an asym g32 grid whose scales are not bf16 numbers (a GGUF's fp16 ones): rounding gives the
    levels back, off only by the scales' bf16 rounding; GPTQ's error feedback moves weights off the grid, so such
    a layer keeps the rounded levels, as the lower output error on its calibration inputs."""
    model = tiny_random_model()[0]
    rtn = LayerQuantSpec("int4", 32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, linear in linear_modules(model):
            q, scales, zeros = quantize_int4(linear.weight, rtn)
            scales = scales * (1 + 3e-3 * torch.rand(scales.shape, generator=g))  # off bf16
            linear.weight.copy_(dequantize_groupwise_int4(q, scales, zeros, 32))
    expected = {n: fake_quantize(m.weight, rtn) for n, m in linear_modules(model)}
    errors = gptq.quantize_sequential(
        model, gptq.as_gptq(QuantPlan({"_default": rtn})), _samples(), progress=False
    )
    rounded = [n for n, e in errors.items() if not e.kept_gptq]
    assert len(rounded) >= len(errors) // 2, errors
    for name in rounded:
        assert torch.equal(model.get_submodule(name).dequantize(), expected[name]), name
    assert f"{len(rounded)} kept round-to-nearest's" in gptq.summary(errors)


def test_gptq_on_8_bit_grids_lowers_the_output_error_and_stores_codes(float_inputs):
    model, inputs = float_inputs
    spec = LayerQuantSpec("int4", 32, scale_bits=8, method="gptq")
    rtn = LayerQuantSpec("int4", 32, scale_bits=8)
    for name in ("layers.0.attn.qkv_proj", "layers.1.mlp.down_proj"):
        linear, x = model.get_submodule(name), inputs[name]
        hessian = 2 * x.T @ x / len(x)
        levels = gptq.gptq_int4(linear.weight, hessian, spec)
        module = Int4Linear.from_levels(linear, spec, *levels, torch.float32)  # the grids are on their codes
        assert "scale_codes" in module.state_dict()
        error = gptq.output_error(linear.weight, module.dequantize(), hessian)
        assert error < 0.95 * gptq.output_error(linear.weight, fake_quantize(linear.weight, rtn), hessian)


def test_gptq_on_a_split_output_projection_rounds_its_int4_rows_and_corrects_the_bias():
    """Split rows: the int8 rows as round-to-nearest chooses and stores them, GPTQ levels on the int4 rows (a lower
    output error), and the correction bias computed from the weights as stored."""
    model = tiny_random_model()[0]
    head = model.get_submodule("lm_head")
    mean = torch.randn(head.in_features).abs()
    split = LayerQuantSpec("int4", 32, high_rows=0.25, bias_correction="mean")
    rtn_module = build_linear("lm_head", head, split, torch.float32, {"mean": mean})
    quantized = copy.deepcopy(model)
    plan = gptq.as_gptq(QuantPlan({"lm_head": split, "_default": "fp32"}))
    assert plan.spec_for("lm_head").method == "gptq"
    errors = gptq.quantize_sequential(quantized, plan, _samples(), {"mean": mean}, progress=False)
    module = quantized.lm_head
    assert isinstance(module, SplitRowsLinear) and errors["lm_head"].ratio < 0.95, errors
    assert torch.equal(module.high_index, rtn_module.high_index)
    assert torch.equal(module.high.dequantize(), rtn_module.high.dequantize())
    assert not torch.equal(module.low.dequantize(), rtn_module.low.dequantize())
    expected_bias = correction_bias(head.weight, module.dequantize(), mean)
    assert torch.allclose(module.bias, expected_bias, atol=1e-6)
    x = torch.randn(3, head.in_features)
    assert torch.allclose(module(x), x @ module.dequantize().T + module.bias, atol=2e-2)


def test_auto_method_gives_a_dqg_plan_gptq_levels_and_uniform_targets_rounding(monkeypatch):
    assert QuantConfig().method == "auto"
    assert QuantConfig(enable_dqg=True, bits_budget=5.0).levels_method == "gptq"
    assert QuantConfig(target_precision="int4").levels_method == "rtn"  # no calibration needed
    assert QuantConfig(enable_dqg=True, bits_budget=6.0, pressure_bits_budget=4.5).levels_method == "rtn"
    assert QuantConfig(enable_dqg=True, bits_budget=5.0, method="rtn").levels_method == "rtn"
    monkeypatch.setattr(recipe, "hardware_candidates", lambda device="cpu": (FORMATS, {}))
    model = tiny_random_model()[0]
    config = QuantConfig(enable_dqg=True, bits_budget=5.0, calibration_source="random", calibration_samples=2)
    calibration = CalibrationSettings(source="random", num_samples=2, max_len=96)
    result = recipe.quantize_model(model, None, config, calibration=calibration, progress=False)
    assert gptq.uses_gptq(result.plan, model) and any(note.startswith("GPTQ: ") for note in result.notes)
