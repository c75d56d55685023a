"""DQG: analytic bits, clamping, the knapsack allocation, budgets, and a measured win over uniform int4."""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
import warnings

import pytest
import torch

from mcp2026.bench.quality import evaluate, reference_logprobs
from mcp2026.config import QuantConfig
from mcp2026.loading.loader import load_model
from mcp2026.quant import dqg, dqg_options, recipe, uniform_plan
from mcp2026.quant.calibrate import CalibrationSettings, calibrate, calibration_samples
from mcp2026.quant.perplexity import windows_from_tokens
from mcp2026.quant.plan import LayerQuantSpec, linear_modules
from mcp2026.quant.quantizer import fake_quantize
from mcp2026.quant.stats import weight_stats

FORMATS = ("fp32", "int8", "int4")
FP32_KERNELS = {"int8": torch.float32, "int4": torch.float32}  # exact activations for comparisons
CALIB = CalibrationSettings(source="random", num_samples=4, max_len=96, max_rows=128, fisher_samples=4)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def measured(tiny_llama_dir):
    loaded = load_model(tiny_llama_dir)
    calib = calibrate(loaded.model, calibration_samples(CALIB, None, 320), CALIB, progress=False)
    layers = dqg.measure_options(
        loaded.model, calib, FORMATS, dqg_options.DQGSettings(precompensation="all"), False
    )
    return loaded.model, layers, calib


def _config(**kwargs) -> QuantConfig:
    """A DQG config whose plans these tests apply themselves: round-to-nearest levels (the default "auto" gives a
    single DQG plan GPTQ's, which ``recipe.apply`` quantizes only with calibration samples)."""
    kwargs.setdefault("method", "rtn")
    return QuantConfig(enable_dqg=True, calibration_source="random", calibration_samples=4, **kwargs)


# ---- analytic mode and clamping ------------------------------------------------------------------
def test_analytic_bits_formula():
    assert dqg.analytic_bits(1.0, 1.0) == 1  # log2(2)
    assert dqg.analytic_bits(15.0, 1.0) == 4  # log2(16)
    assert dqg.analytic_bits(16.0, 1.0) == 5  # ceil(log2(17))
    assert dqg.analytic_bits(255.0, 1.0) == 8
    assert dqg.analytic_bits(0.0, 1.0) == 1
    with pytest.raises(ValueError, match="eps > 0"):
        dqg.analytic_bits(1.0, 0.0)


def test_analytic_plan_clamps_to_candidates(measured):
    model, layers = measured[:2]
    name = next(iter(layers))
    sigma = layers[name].out_sigma
    for bits, fmt in ((4, "int4"), (5, "int4"), (6, "int8"), (12, "int8"), (20, "fp32")):
        eps = {n: sigma / (2**bits - 1.5) for n in layers}  # b* = bits for this layer
        chosen = dqg.analytic_choice(layers, eps, FORMATS, 32, symmetric=False)
        assert chosen[name][0] == bits and chosen[name][1].spec.format == fmt
    result = recipe._analytic(layers, QuantConfig(enable_dqg=True), FORMATS, dqg_options.DQGSettings())
    assert result.mode == "analytic" and set(result.analytic) == set(layers)
    assert all(o.spec.format in FORMATS for o in result.choices.values())


def test_unavailable_format_clamps_with_warning_or_raises_when_strict():
    with pytest.warns(UserWarning, match=r"fp8 has no fast kernel.*nearest candidate is int8"):
        assert uniform_plan.resolve_format("fp8", FORMATS, strict=False) == "int8"
    with pytest.raises(ValueError, match=r"Candidates: fp32 \(32 bits\), int8 \(8 bits\), int4 \(4 bits\)"):
        uniform_plan.resolve_format("fp8", FORMATS, strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert uniform_plan.resolve_format("int4", FORMATS, strict=True) == "int4"


# ---- allocation ----------------------------------------------------------------------------------
def _fake_layers(costs_errors: list[list[tuple[float, float]]]) -> dict[str, dqg_options.LayerOptions]:
    stats = weight_stats(torch.randn(8, 8))
    layers = {}
    for i, pairs in enumerate(costs_errors):
        options = [dqg_options.Option(LayerQuantSpec("int8"), "", bits, err, err) for bits, err in pairs]
        layers[f"l{i}"] = dqg_options.LayerOptions(f"l{i}", "linear", 1, 1, False, stats, 0, 0, 0, 0, options)
    return layers


def test_allocate_matches_brute_force_and_respects_budget():
    rng = random.Random(0)
    for _ in range(30):
        instance = []
        for _ in range(4):
            bits = sorted(rng.sample([4.25, 4.5, 5.0, 8.0, 16.0, 32.0], 4))
            instance.append([(b, rng.uniform(0.5, 1.5) * 2.0**-b) for b in bits])
        layers = _fake_layers(instance)
        budget = rng.uniform(sum(p[0][0] for p in instance), sum(p[-1][0] for p in instance))
        chosen = dqg.allocate(layers, budget)
        assert sum(o.bits for o in chosen.values()) <= budget + 1e-9
        best = min(
            sum(e for _, e in combo)
            for combo in itertools.product(*instance)
            if sum(c for c, _ in combo) <= budget
        )
        assert dqg.total_error(layers, chosen) <= best * 1.5  # greedy + fill: near the optimum
    convex = _fake_layers([[(4, 8.0), (5, 4.0), (8, 1.0)], [(4, 2.0), (5, 1.5), (8, 1.0)]])
    assert {n: o.bits for n, o in dqg.allocate(convex, 9).items()} == {"l0": 5, "l1": 4}


def test_impossible_budget_is_a_clear_error(measured, tiny_llama_dir):
    model, layers = measured[:2]
    with pytest.raises(dqg.BudgetError, match="impossible budget: the cheapest plan needs"):
        dqg.allocate(layers, 3.0 * sum(lo.numel for lo in layers.values()))
    with pytest.raises(dqg.BudgetError, match=r"bits_budget=3.*candidate formats: fp32, int8, int4"):
        recipe.plan_for_config(
            model, None, _config(bits_budget=3.0), formats=FORMATS, calibration=CALIB, progress=False
        )


@pytest.mark.parametrize("bits", [4.5, 5.0, 6.0])
def test_bits_budget_is_respected(measured, bits):
    model, layers = measured[:2]
    chosen = dqg.allocate(layers, bits * sum(lo.numel for lo in layers.values()))
    plan, _ = dqg.plan_from_choices(chosen)
    assert plan.avg_bits_per_weight(model) <= bits + 1e-9
    assert dqg.avg_bits(layers, chosen) == pytest.approx(plan.avg_bits_per_weight(model))


def test_bytes_budget_is_respected_with_tied_lm_head(tmp_path):
    from conftest import save_tiny_hf

    model = load_model(save_tiny_hf(tmp_path / "tied", tie=True)).model
    budget = uniform_plan.uniform_plan(model, LayerQuantSpec("int4", 64)).total_bytes(model)
    result = recipe.plan_for_config(
        model, None, _config(bytes_budget=budget), formats=FORMATS, calibration=CALIB, progress=False
    )
    assert result.plan.total_bytes(model) <= budget
    assert recipe.fixed_bytes(model, result.layers) > 0


def test_more_bits_never_increase_error(measured):
    _, layers, _ = measured
    numel = sum(lo.numel for lo in layers.values())
    errors = [dqg.total_error(layers, dqg.allocate(layers, b * numel)) for b in (4.5, 5.0, 6.0, 8.1, 32)]
    assert errors == sorted(errors, reverse=True) and errors[-1] == 0.0


# ---- measured plans --------------------------------------------------------------------------------
def test_precompensation_variants_are_measured_and_reported(measured):
    model, layers = measured[:2]
    chosen = dqg.allocate(layers, 4.6 * sum(lo.numel for lo in layers.values()))
    plan, scales = dqg.plan_from_choices(chosen)
    result = dqg.DQGResult("measured", plan, scales, "bits_budget=4.6", layers, chosen)
    report = result.precompensation_report()
    assert {"mse_clip", "awq"} <= set(report)
    for technique in report.values():
        assert 0 <= technique["helped_share"] <= 1
        if technique["applied_layers"]:
            assert technique["applied_mean_reduction"] > 0  # only chosen where it measurably helps
    data = json.loads(result.to_json())
    assert data["plan_id"] == plan.plan_id and len(data["layers"]) == len(layers)
    assert set(data["layers"][0]) >= {"layer", "role", "sigma_w", "kurtosis", "format", "bits", "rel_error"}
    from rich.console import Console

    Console(width=250, record=True).print(result.to_table())


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory):
    from conftest import save_tiny_hf

    return save_tiny_hf(tmp_path_factory.mktemp("wide"), hidden_size=128, intermediate_size=256)


def _heterogeneous(model_dir):
    """Layers of very different sensitivity: layer 0 already on the symmetric int4 g128 grid (nothing to
    lose at 4.25 bits, like a model shipped pre-quantized), layer 1's o_proj with outlier weights."""
    model = load_model(model_dir).model
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for linear in (model.layers[0].attn.qkv_proj, model.layers[0].attn.o_proj,
                       model.layers[0].mlp.gate_up_proj, model.layers[0].mlp.down_proj):  # fmt: skip
            linear.weight.copy_(fake_quantize(linear.weight, LayerQuantSpec("int4", 128, symmetric=True)))
        w = model.layers[1].attn.o_proj.weight
        w[torch.rand(w.shape, generator=g) < 0.02] *= 25
    return model


def test_dqg_beats_uniform_int4_at_equal_bits(wide_dir):
    import copy

    model = _heterogeneous(wide_dir)
    tokens = torch.randint(320, (512,), generator=torch.Generator().manual_seed(7)).tolist()
    windows = windows_from_tokens(tokens, 128)  # random tokens, not the calibration ones (seed 0)
    reference = reference_logprobs(model, windows)
    uniform = uniform_plan.uniform_plan(model, LayerQuantSpec("int4", 64, symmetric=True))
    bits = uniform.avg_bits_per_weight(model)
    config = _config(bits_budget=bits, symmetric=True)
    result = recipe.plan_for_config(model, None, config, formats=FORMATS, calibration=CALIB, progress=False)
    assert result.plan.avg_bits_per_weight(model) <= bits
    scores = {}
    for name, res in (("uniform", dqg.DQGResult("uniform", uniform)), ("dqg", result)):
        quantized = recipe.apply(copy.deepcopy(model), res, FP32_KERNELS, progress=False)
        scores[name] = evaluate(quantized, windows, reference)
    assert scores["dqg"].kld < 0.5 * scores["uniform"].kld, scores
    assert scores["dqg"].ppl <= scores["uniform"].ppl * 1.001
    assert result.plan.spec_for("layers.1.attn.o_proj").format == "int8"  # the outlier layer gets bits
    assert result.plan.spec_for("layers.0.mlp.gate_up_proj").group_size == 128  # from the free layer


def test_8_bit_scales_are_candidates_and_win_where_weights_sit_on_a_g32_grid(measured, wide_dir):
    """Each int4 candidate with zero points is measured again on 8-bit grids (its bits 16/g - 16/K lower, its
    error close on random weights). On weights stored on fp16 grids of 32 (a Q4_1 file), a budget between g64 and
    g32 goes to 8-bit g32 rather than coarser groups."""
    layers = measured[1]
    for lo in layers.values():
        for o in (
            o for o in lo.options if o.spec.format == "int4" and not o.spec.high_rows and not o.variant
        ):
            if o.spec.symmetric:
                assert o.spec.scale_bits == 16
                continue
            other = next(
                p for p in lo.options if not p.variant and p.spec == dataclasses.replace(o.spec, scale_bits=24 - o.spec.scale_bits)
            )  # fmt: skip
            coded, fp16 = (o, other) if o.spec.scale_bits == 8 else (other, o)
            g = o.spec.group_size
            assert coded.bits == pytest.approx(fp16.bits - 16 / g + 16 / lo.in_features)
            assert coded.error <= 1.1 * fp16.error
    model = load_model(wide_dir).model
    with torch.no_grad():
        for _, linear in linear_modules(model):
            linear.weight.copy_(fake_quantize(linear.weight, LayerQuantSpec("int4", 32)))
    calib = calibrate(model, calibration_samples(CALIB, None, 320), CALIB, progress=False)
    grid = dqg.measure_options(model, calib, FORMATS, dqg_options.DQGSettings(precompensation="none"), False)
    numel = sum(lo.numel for lo in grid.values())
    chosen = dqg.allocate(grid, 4.75 * numel)  # 8-bit g32: 4.5 + 16 / K bits (K = 128 or 256 here)
    body = {n: o.label for n, o in chosen.items() if n != "lm_head"}
    assert all(label.startswith("int4 g32 asym") for label in body.values()), body  # no coarser groups
    assert sum(label == "int4 g32 asym s8" for label in body.values()) >= len(body) // 2, body


def test_max_ppl_increase_search(wide_dir):
    model = _heterogeneous(wide_dir)
    result = recipe.plan_for_config(
        model, None, _config(max_ppl_increase=0.002), formats=FORMATS, calibration=CALIB, progress=False
    )
    assert result.ppl_checks and result.mode == "measured"
    final = [c for c in result.ppl_checks if c["avg_bits"] == pytest.approx(result.avg_bits)]
    assert final and all(c["increase"] <= 0.002 for c in final)


def test_uniform_plan_falls_back_where_group_does_not_divide(measured):
    model = measured[0]  # hidden 64: g128 only fits the down projection (K = 128)
    plan = uniform_plan.uniform_plan(model, LayerQuantSpec("int4", 128, symmetric=True))
    assert plan.spec_for("layers.0.mlp.down_proj").group_size == 128
    assert plan.spec_for("layers.0.attn.qkv_proj") == LayerQuantSpec("int4", 64, symmetric=True)


def test_pinned_lm_head_precision_holds_under_the_dqg(measured):
    model, layers, calib = measured
    for fmt, bits in (("int4", 6.0), ("fp32", 12.0)):
        free = recipe._allocate(
            model, calib, layers, _config(bits_budget=bits), FORMATS, dqg_options.DQGSettings(), False
        )
        config = _config(bits_budget=bits, lm_head_precision=fmt)
        result = recipe._allocate(model, calib, layers, config, FORMATS, dqg_options.DQGSettings(), False)
        head = result.plan.spec_for("lm_head")
        assert head.format == fmt and not head.high_rows and free.plan.spec_for("lm_head") != head
        assert result.plan.avg_bits_per_weight(model) <= bits + 1e-9
    config = QuantConfig(enable_dqg=True, lm_head_precision="int8")  # analytic: b* does not choose the head
    result = recipe._allocate(model, calib, layers, config, FORMATS, dqg_options.DQGSettings(), False)
    assert result.mode == "analytic" and result.plan.spec_for("lm_head") == LayerQuantSpec("int8")
    with pytest.raises(ValueError, match="lm_head_precision=fp8: not among the formats measured"):
        recipe.pin_output(layers, "fp8")


# ---- Pipeline wiring ---------------------------------------------------------------------------------
@pytest.fixture
def fixed_candidates(monkeypatch):
    monkeypatch.setattr(recipe, "hardware_candidates", lambda device="cpu": (FORMATS, dict(FP32_KERNELS)))


def test_pipeline_uniform_int8(tiny_llama_dir, fixed_candidates):
    from mcp2026 import Pipeline
    from mcp2026.quant.int8_linear import Int8Linear

    pipe = Pipeline(model=tiny_llama_dir, config=QuantConfig(target_precision="int8"), dtype="fp32")
    linears = [m for n, m in pipe.loaded.model.named_modules() if n.endswith(("proj", "lm_head"))]
    assert linears and all(isinstance(m, Int8Linear) for m in linears)
    assert pipe.quant_result.mode == "uniform"
    out = pipe.engine  # the engine runs the quantized model
    request = out.add_request([1, 2, 3])
    while out.has_unfinished():
        out.step()
    assert request


def test_pipeline_dqg_budget(tiny_llama_dir, fixed_candidates):
    from mcp2026 import Pipeline

    pipe = Pipeline(model=tiny_llama_dir, config=_config(bits_budget=4.5), dtype="fp32")
    assert pipe.quant_result.mode == "measured"
    assert pipe.quant_result.plan.avg_bits_per_weight(pipe.loaded.model) <= 4.5 + 1e-9


def test_lm_head_split_options_are_measured_and_applied(measured):
    import copy

    from mcp2026.quant.split_rows_linear import SplitRowsLinear

    model, layers = measured[:2]
    head = layers["lm_head"]
    splits = [o for o in head.options if o.spec.high_rows]
    assert splits and not any(
        o.spec.high_rows for n, lo in layers.items() if n != "lm_head" for o in lo.options
    )
    int8 = next(o for o in head.options if o.spec == LayerQuantSpec("int8"))
    for o in splits:
        assert o.spec.row_scores in o.tensors and o.label.startswith("int4") and "rows int8" in o.label
        base = LayerQuantSpec("int4", o.spec.group_size, o.spec.symmetric, scale_bits=o.spec.scale_bits)
        plain = next(p for p in head.options if p.spec == base and not p.variant)
        assert plain.bits < o.bits < int8.bits
        if not o.variant:  # int8 rows only replace int4 rows where that lowers the (Fisher-weighted) error
            assert o.error <= plain.error
    corrected = next(o for o in splits if o.variant == "bias_corr")
    # the DQG measures splits from per-row error columns; the same error straight from the module's weights:
    from mcp2026.quant.quantizer import correction_bias

    w = model.lm_head.weight.detach()
    calib = measured[2]
    x, mean = calib.layers["lm_head"].rows, calib.layers["lm_head"].activations.mean
    wq = fake_quantize(w, corrected.spec, None, corrected.tensors[corrected.spec.row_scores])
    dy = x @ (wq - w).T + correction_bias(w, wq, mean)
    assert corrected.rel_error == pytest.approx((dy.pow(2).sum() / (x @ w.T).pow(2).sum()).item(), rel=1e-4)
    choices = {n: min(lo.options, key=lambda o: o.bits) for n, lo in layers.items()}
    choices["lm_head"] = corrected
    plan, tensors = dqg.plan_from_choices(choices)
    assert set(tensors) == {corrected.spec.row_scores, corrected.spec.bias_correction}
    quantized = recipe.apply(
        copy.deepcopy(model), dqg.DQGResult("measured", plan, tensors), FP32_KERNELS, False
    )
    module = quantized.lm_head
    assert isinstance(module, SplitRowsLinear) and module.bias is not None
    w = model.lm_head.weight.detach()
    assert torch.equal(
        module.dequantize(), fake_quantize(w, corrected.spec, None, tensors[corrected.spec.row_scores])
    )
    result = dqg.DQGResult("measured", plan, tensors, "test", layers, choices)
    assert "bias_corr" in result.precompensation_report()
    assert abs(plan.avg_bits_per_weight(model) - result.avg_bits) < 1e-9
    # the quantized model counts the split lm_head once (not again through its int8 and int4 halves)
    assert abs(plan.avg_bits_per_weight(quantized) - result.avg_bits) < 1e-9
    assert abs(plan.total_bytes(quantized) - plan.total_bytes(model)) <= 16
    report = result.precompensation_report()["bias_corr"]
    assert report["applied_layers"] == 1 and report["measured"] == sum(
        o.variant == "bias_corr" for o in splits
    )
