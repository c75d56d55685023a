"""From a QuantConfig to a quantized model: resolve the request against this device's candidate formats,
then either a uniform plan, or calibrate and let the DQG choose (analytic, or measured under a budget of
bits per weight, bytes, or perplexity increase), and quantize in place. Used by Pipeline and compile.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

from mcp2026.config import QuantConfig
from mcp2026.quant import backend, dqg, gptq, learned_scales
from mcp2026.quant.calibrate import CalibrationSettings, _progress, calibrate, calibration_samples
from mcp2026.quant.dqg import BudgetError, DQGResult
from mcp2026.quant.dqg_options import DQGSettings, LayerOptions
from mcp2026.quant.gate import QuantGate
from mcp2026.quant.int8_group_linear import Int8GroupLinear
from mcp2026.quant.linear import quantize_
from mcp2026.quant.perplexity import perplexity
from mcp2026.quant.plan import (
    DENSE_FORMATS,
    OUTPUT_PROJECTION,
    WEIGHT_BITS,
    LayerQuantSpec,
    QuantPlan,
)
from mcp2026.quant.quantizer import correction_bias, fake_quantize
from mcp2026.quant.uniform_plan import QUANT_FORMATS, format_spec, uniform_plan, uniform_result

FAST_DTYPE = {"int8": torch.bfloat16, "int4": torch.bfloat16}  # see hardware_candidates


def hardware_candidates(device: str | torch.device = "cpu") -> tuple[tuple[str, ...], dict[str, torch.dtype]]:
    """(candidate formats, format -> compute dtype) from the backend probe.

    NOTE: the probe does not cache timings taken while other processes keep the CPU busy, and such
    timings are not evidence either way (a busy 2-core machine slows every kernel 10-100x). Then the
    formats with a real kernel count as candidates, and the int kernels run in bf16, where they are
    known to be fast (the cached probes of quiet runs on AVX2 and AVX-512 machines agree).
    """
    device = torch.device(device)
    report = backend.probe(device)
    if device.type != "cpu" or report.load_avg <= backend.BUSY_LOAD:
        return report.candidates(), report.compute_dtypes
    formats = [f for f, r in report.formats.items() if r.has_kernel and (f in QUANT_FORMATS or f == "fp32")]
    warnings.warn(
        f"CPU busy (load {report.load_avg:.1f}): candidate formats by kernel availability: {formats}",
        stacklevel=2,
    )
    dtypes = {**report.compute_dtypes, **{f: d for f, d in FAST_DTYPE.items() if f in formats}}
    return tuple(sorted(formats, key=WEIGHT_BITS.get)), dtypes


def _granularity_formats(config: QuantConfig, formats: Sequence[str]) -> list[str]:
    # per_group: int4, and for a uniform plan int8 in groups (the DQG measures int8 per channel only)
    keep = {
        "per_channel": ("int8", "fp8"),
        "per_group": ("int4",) if config.enable_dqg else ("int4", "int8"),
    }.get(config.granularity)
    if config.granularity == "per_tensor":
        message = "per-tensor granularity has no kernel here; using per-channel int8 / group-wise int4"
        if config.strict:
            raise ValueError(message)
        warnings.warn(message, stacklevel=3)
    return [f for f in formats if keep is None or f in keep or f in DENSE_FORMATS]


def _budget(config: QuantConfig) -> tuple[str, float] | None:
    given = {
        k: getattr(config, k)
        for k in ("bits_budget", "bytes_budget", "max_ppl_increase")
        if getattr(config, k) is not None
    }
    if len(given) > 1:
        raise ValueError(f"set one budget, not {sorted(given)}")
    if given:
        return next(iter(given.items()))
    if config.target_precision in QUANT_FORMATS:  # DQG at the cost of the uniform target
        spec = LayerQuantSpec(config.target_precision, config.group_size, config.symmetric)
        return "bits_budget", spec.bits_per_weight(1 << 20)
    return None  # analytic


def fake_quantized_weights(
    model: nn.Module, plan: QuantPlan, tensors: Mapping[str, Tensor] | None = None
) -> dict[str, tuple[Tensor, Tensor | None]]:
    """name -> (weight, bias) each planned linear would compute with, as fp tensors (quick quality checks)."""
    tensors = tensors or {}
    out = {}
    for name, m in model.named_modules():
        spec = plan.spec_for(name)
        if isinstance(m, nn.Linear) and spec is not None and spec.format != "fp32":
            w = m.weight.detach()
            scale = None if spec.act_scale is None else tensors[spec.act_scale]
            scores = None if spec.row_scores is None else tensors[spec.row_scores]
            wq = fake_quantize(w, spec, scale, scores)
            bias = None if m.bias is None else m.bias.detach().float()
            if spec.bias_correction is not None:
                correction = correction_bias(w, wq, tensors[spec.bias_correction])
                bias = correction if bias is None else bias + correction
            out[name] = (wq.to(w.dtype), None if bias is None else bias.to(w.dtype))
    return out


class swapped_weights:  # noqa: N801 - used as a context manager, like torch.no_grad
    """Temporarily give linears other weights and biases (new Parameters, so a tied embedding is left alone)."""

    def __init__(self, model: nn.Module, weights: Mapping[str, tuple[Tensor, Tensor | None]]) -> None:
        self.model, self.weights, self.saved = model, weights, {}

    def __enter__(self) -> nn.Module:
        for name, (w, b) in self.weights.items():
            m = self.model.get_submodule(name)
            self.saved[name] = (m.weight, m.bias)
            m.weight = nn.Parameter(w, requires_grad=False)
            m.bias = None if b is None else nn.Parameter(b, requires_grad=False)
        return self.model

    def __exit__(self, *exc: object) -> None:
        for name, (w, b) in self.saved.items():
            m = self.model.get_submodule(name)
            m.weight, m.bias = w, b


def plan_for_config(
    model: nn.Module,
    tokenizer: object | None,
    config: QuantConfig,
    *,
    formats: Sequence[str],
    settings: DQGSettings | None = None,
    calibration: CalibrationSettings | None = None,
    progress: bool = True,
    grouped_int8: bool = False,
) -> DQGResult:
    """The plan ``config`` asks for on a device whose candidate formats are ``formats`` (``grouped_int8``: it
    runs int8 in groups of 32, ``uniform_plan.with_output``)."""
    formats = _granularity_formats(config, formats)
    if not config.enable_dqg:
        result = uniform_result(model, config, formats, grouped_int8)
    else:
        settings = settings or DQGSettings(symmetric_only=config.symmetric)
        calib, layers = _measure(model, tokenizer, config, formats, settings, calibration, progress)
        result = _allocate(model, calib, layers, config, formats, settings, progress)
        result.calibration = dataclasses.asdict(calibration_settings(config, calibration))
    method = config.levels_method
    if method != "rtn":
        result.plan = gptq.as_gptq(result.plan, method)
        if not _calibrated_levels(result.plan, model) and config.method != "auto":
            warnings.warn(
                f"method={config.method!r} chooses int4 levels; this plan has no plain int4 layer",
                stacklevel=2,
            )
    return result


def _calibrated_levels(plan: QuantPlan, model: nn.Module) -> bool:
    """Whether some layer's levels come from calibration text (GPTQ or learned scales)."""
    return gptq.uses_gptq(plan, model) or learned_scales.uses_learned(plan, model)


def calibration_settings(config: QuantConfig, calibration: CalibrationSettings | None) -> CalibrationSettings:
    """``calibration``, or the config's source and sample count with the other settings' defaults."""
    return calibration or CalibrationSettings(config.calibration_source, config.calibration_samples)


def _measure(model, tokenizer, config: QuantConfig, formats, settings, calibration, progress: bool):
    """Calibrate, then measure every layer's options (the expensive part a second budget can reuse)."""
    calibration = calibration_settings(config, calibration)
    vocab = model.get_submodule("embed_tokens").num_embeddings
    samples = calibration_samples(calibration, tokenizer, vocab)
    calib = calibrate(model, samples, calibration, progress)
    return calib, dqg.measure_options(model, calib, formats, settings, progress)


def pin_output(layers: dict[str, LayerOptions], fmt: str) -> dict[str, LayerOptions]:
    """``layers`` with the output projection's options cut to format ``fmt`` (no rows split off to int8), as
    a pinned ``lm_head_precision`` asks; an error when it has none of that format."""
    head = layers.get(OUTPUT_PROJECTION)
    if head is None:
        return layers
    options = [o for o in head.options if o.spec.format == fmt and not o.spec.high_rows]
    if not options:
        measured = sorted({o.spec.format for o in head.options})
        raise ValueError(
            f"lm_head_precision={fmt}: not among the formats measured for it ({', '.join(measured)})"
        )
    return {**layers, OUTPUT_PROJECTION: dataclasses.replace(head, options=options)}


def _allocate(model, calib, layers, config: QuantConfig, formats, settings, progress: bool) -> DQGResult:
    result = _allocate_measured(model, calib, layers, config, formats, settings, progress)
    return _cover_unreached(model, result, config, formats)


def _allocate_measured(
    model, calib, layers, config: QuantConfig, formats, settings, progress: bool
) -> DQGResult:
    budget = _budget(config)
    if budget is None:
        return _analytic(layers, config, formats, settings)
    if config.lm_head_precision != "auto":
        layers = pin_output(layers, config.lm_head_precision)
    kind, value = budget
    if kind == "max_ppl_increase":
        return _ppl_search(model, calib, layers, value, settings, progress)
    if kind == "bits_budget":
        unit, limit = "bits", value * sum(lo.numel for lo in layers.values())
    else:
        unit, limit = "bytes", value - fixed_bytes(model, layers)
    try:
        choices = dqg.allocate(layers, limit, unit)
    except BudgetError as error:
        raise BudgetError(f"{kind}={value}: {error}; candidate formats: {', '.join(formats)}") from None
    plan, scales = dqg.plan_from_choices(choices)
    return DQGResult("measured", plan, scales, f"{kind}={value:g}", layers, choices)


def _cover_unreached(model: nn.Module, result: DQGResult, config: QuantConfig, formats) -> DQGResult:
    """Plan the linears no calibration token reached (experts the router never picked on the calibration text):
    nothing was measured for them and they add no error on that text, so the DQG's objective gives them the
    cheapest candidate format their shape takes (as ``uniform_plan`` fits int4 groups). They sit outside the
    budget's accounting, which only lowers the plan's real size below it; the result's notes count them."""
    unreached = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in result.layers]
    quantized = sorted((f for f in formats if f in QUANT_FORMATS), key=WEIGHT_BITS.get)
    if not unreached or not quantized:
        return result
    fmt = quantized[0]
    spec = format_spec(fmt, config)
    cheapest = uniform_plan(model, spec)
    rules = {name: cheapest.spec_for(name) for name in unreached}
    result.plan = QuantPlan({**rules, **result.plan.to_dict()})
    result.notes.append(
        f"{len(unreached)} linears no calibration token reached (e.g. {unreached[0]}) run as {spec.describe()}: "
        "nothing was measured for them"
    )
    return result


def fixed_bytes(model: nn.Module, layers: dict[str, LayerOptions]) -> int:
    """Bytes a plan does not decide: everything but the planned linears' weights (tied ones count there)."""
    planned = sum(
        0
        if lo.is_tied
        else model.get_submodule(n).weight.numel() * model.get_submodule(n).weight.element_size()
        for n, lo in layers.items()
    )
    return QuantPlan({}).total_bytes(model) - planned


def _analytic(layers, config: QuantConfig, formats, settings: DQGSettings) -> DQGResult:
    if not all(lo.output_fisher > 0 for lo in layers.values()):
        raise ValueError("analytic mode needs output sensitivities: calibrate with fisher_samples > 0")
    eps = dqg.analytic_eps(layers, settings.analytic_kld)
    picked = dqg.analytic_choice(layers, eps, formats, config.group_size, config.symmetric)
    if config.lm_head_precision != "auto" and OUTPUT_PROJECTION in layers:  # pinned: b* does not choose it
        head = pin_output({OUTPUT_PROJECTION: layers[OUTPUT_PROJECTION]}, config.lm_head_precision)
        picked.update(
            dqg.analytic_choice(head, eps, [config.lm_head_precision], config.group_size, config.symmetric)
        )
    choices = {n: o for n, (_, o) in picked.items()}
    plan, scales = dqg.plan_from_choices(choices)
    result = DQGResult(
        "analytic", plan, scales, f"analytic, total KLD {settings.analytic_kld:g}", layers, choices
    )
    result.analytic = {n: b for n, (b, _) in picked.items()}
    return result


def _ppl_search(
    model, calib, layers, max_increase: float, settings: DQGSettings, progress: bool
) -> DQGResult:
    """Bisection over the bits budget for the cheapest measured plan whose perplexity on calibration
    samples (fake-quantized weights) is within ``max_increase`` (relative) of the unquantized model's."""
    windows = calib.samples[: settings.ppl_check_samples]
    numel = sum(lo.numel for lo in layers.values())
    base_ppl = perplexity(model, windows)
    lo_bits = sum(min(lo.numel * o.bits for o in lo.options) for lo in layers.values()) / numel
    quantized = [o.bits for lo in layers.values() for o in lo.options if o.spec.format not in DENSE_FORMATS]
    hi_bits = max(quantized, default=lo_bits)
    checks: list[dict[str, float]] = []

    def check(bits: float) -> tuple[bool, dict]:
        choices = dqg.allocate(layers, bits * numel, "bits")
        plan, scales = dqg.plan_from_choices(choices)
        with swapped_weights(model, fake_quantized_weights(model, plan, scales)):
            ppl = perplexity(model, windows)
        increase = ppl / base_ppl - 1
        checks.append({"bits_budget": bits, "avg_bits": dqg.avg_bits(layers, choices), "ppl": ppl,
                       "base_ppl": base_ppl, "increase": increase})  # fmt: skip
        return increase <= max_increase, choices

    with _progress(progress) as bar:
        task = bar.add_task("perplexity search", total=settings.ppl_iterations + 1)
        ok, best = check(hi_bits)
        bar.advance(task)
        if not ok:
            raise BudgetError(
                f"max_ppl_increase={max_increase:g}: even {hi_bits:.2f} bits/weight gives "
                f"+{checks[-1]['increase']:.2%} perplexity on calibration text"
            )
        lo, hi = lo_bits, hi_bits
        for _ in range(settings.ppl_iterations):
            mid = (lo + hi) / 2
            ok, choices = check(mid)
            lo, hi, best = (lo, mid, choices) if ok else (mid, hi, best)
            bar.advance(task)
    plan, scales = dqg.plan_from_choices(best)
    return DQGResult(
        "measured", plan, scales, f"max_ppl_increase={max_increase:g}", layers, best, ppl_checks=checks
    )


def apply(
    model: nn.Module,
    result: DQGResult,
    compute_dtypes: dict[str, torch.dtype] | None,
    progress: bool = True,
    *,
    samples: Sequence[Sequence[int]] | None = None,
    gptq_settings: gptq.GPTQSettings | None = None,
    learned_settings: learned_scales.LearnedScaleSettings | None = None,
) -> nn.Module:
    """Quantize ``model`` in place as ``result.plan`` says, one layer at a time (with a progress bar). A plan
    with GPTQ or learned-scale layers runs layer after layer on ``samples`` (token ids of calibration text;
    ``quant.gptq``, ``quant.learned_scales``), and ``result.notes`` gets lines on how their output errors compare
    with round-to-nearest's."""
    if _calibrated_levels(result.plan, model):
        if not samples:
            raise ValueError(
                "a plan with GPTQ or learned-scale layers needs calibration samples to quantize with"
            )
        ids = [torch.tensor(list(s), dtype=torch.long) for s in samples]
    if learned_scales.uses_learned(result.plan, model):
        if gptq.uses_gptq(result.plan, model):
            raise ValueError("a plan mixes GPTQ and learned-scale layers; choose one method per plan")
        errors = learned_scales.quantize_sequential(
            model, result.plan, ids, result.tensors, compute_dtypes,
            learned_settings or learned_scales.LearnedScaleSettings(), progress,
        )  # fmt: skip
        result.notes += [learned_scales.summary(errors), learned_scales.per_layer(errors)]
        return model
    if gptq.uses_gptq(result.plan, model):
        errors = gptq.quantize_sequential(
            model,
            result.plan,
            ids,
            result.tensors,
            compute_dtypes,
            gptq_settings or gptq.GPTQSettings(),
            progress,
        )
        result.notes.append(gptq.summary(errors))
        return model
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    with _progress(progress) as bar:
        task = bar.add_task("quantizing", total=len(names))
        for name in names:
            spec = result.plan.spec_for(name)
            if spec is not None:
                quantize_(model, QuantPlan({name: spec}), result.tensors, compute_dtypes)
            bar.advance(task)
    return model


def quantize_model(
    model: nn.Module,
    tokenizer: object | None,
    config: QuantConfig,
    device: str | torch.device = "cpu",
    *,
    settings: DQGSettings | None = None,
    calibration: CalibrationSettings | None = None,
    gptq_settings: gptq.GPTQSettings | None = None,
    learned_settings: learned_scales.LearnedScaleSettings | None = None,
    progress: bool = True,
) -> DQGResult:
    """Plan (on this device's candidates) and quantize in place; returns how the plan was chosen. GPTQ and
    learned-scale layers are quantized on the calibration text of ``calibration`` (the config's source and
    sample count by default)."""
    formats, dtypes = hardware_candidates(device)
    result = plan_for_config(
        model,
        tokenizer,
        config,
        formats=formats,
        settings=settings,
        calibration=calibration,
        progress=progress,
        grouped_int8=Int8GroupLinear.kernel_on(torch.device(device)) is not None,
    )
    samples = None
    if _calibrated_levels(result.plan, model):
        calibration = calibration_settings(config, calibration)
        vocab = model.get_submodule("embed_tokens").num_embeddings
        samples = calibration_samples(calibration, tokenizer, vocab)
        result.calibration = dataclasses.asdict(calibration)
    apply(model, result, dtypes, progress, samples=samples, gptq_settings=gptq_settings,
          learned_settings=learned_settings)  # fmt: skip
    return result


def describe(result: DQGResult, model: nn.Module) -> str:
    """One line: mode, average bits per linear weight (as stored) and weight bytes."""
    bits = result.plan.avg_bits_per_weight(model)
    size = result.plan.total_bytes(model) / 2**20
    return f"{result.mode} plan {result.plan.plan_id}: {bits:.3f} bits/weight, {size:.1f} MiB of weights" + (
        "" if math.isnan(result.predicted_error) else f", est. error {result.predicted_error:.4g}"
    )


def gate_for_config(
    model: nn.Module,
    tokenizer: object | None,
    config: QuantConfig,
    device: str | torch.device = "cpu",
    progress: bool = True,
    *,
    settings: DQGSettings | None = None,
    calibration: CalibrationSettings | None = None,
) -> tuple[DQGResult, DQGResult, QuantGate]:
    """Quality plan (``config``'s budget) and pressure plan (``pressure_bits_budget``) from one calibration
    and one set of layer measurements; returns both results and the gate holding them (quality installed).
    ``settings``/``calibration``: as for ``quantize_model`` (the quality plan is the one it would choose)."""
    formats, dtypes = hardware_candidates(device)
    formats = _granularity_formats(config, formats)
    settings = settings or DQGSettings(symmetric_only=config.symmetric)
    calib, layers = _measure(model, tokenizer, config, formats, settings, calibration, progress)
    quality = _allocate(model, calib, layers, config, formats, settings, progress)
    quality.calibration = dataclasses.asdict(calibration_settings(config, calibration))
    pressure_config = dataclasses.replace(
        config,
        bits_budget=config.pressure_bits_budget,
        bytes_budget=None,
        max_ppl_increase=None,
        pressure_bits_budget=None,
    )
    pressure = _allocate(model, calib, layers, pressure_config, formats, settings, progress)
    pressure.calibration = quality.calibration
    gate = QuantGate(model, quality.plan, pressure.plan, {**quality.tensors, **pressure.tensors}, dtypes)
    return quality, pressure, gate


def quantize_loaded(
    loaded,
    config: QuantConfig,
    device: str | torch.device = "cpu",
    progress: bool = True,
    *,
    settings: DQGSettings | None = None,
    calibration: CalibrationSettings | None = None,
    gptq_settings: gptq.GPTQSettings | None = None,
    learned_settings: learned_scales.LearnedScaleSettings | None = None,
):
    """Pipeline's quantization step: quantize a freshly loaded model as ``config`` asks (with the DQG and
    calibration settings of its YAML, as ``compile`` does); a compiled artifact is already quantized, so
    there the config's plan is not applied again (a warning says so)."""
    if loaded.file_format == "mcp2026-artifact":
        warnings.warn(
            f"{loaded.source} is a compiled artifact (already quantized): QuantConfig ignored", stacklevel=3
        )
        return None
    return quantize_model(
        loaded.model,
        loaded.tokenizer,
        config,
        device,
        settings=settings,
        calibration=calibration,
        gptq_settings=gptq_settings,
        learned_settings=learned_settings,
        progress=progress,
    )
