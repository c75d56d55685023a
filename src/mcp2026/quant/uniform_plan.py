"""Uniform plans: one spec for every linear, fitted to each layer's width; the output projection's own format
(``QuantConfig.lm_head_precision``); a requested format resolved against this device's candidates."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence

from torch import nn

from mcp2026.config import QuantConfig
from mcp2026.quant.backend import clamp_bits
from mcp2026.quant.block_linear import packable
from mcp2026.quant.dqg import DQGResult
from mcp2026.quant.dqg_options import int4_groups
from mcp2026.quant.plan import (
    DENSE_FORMATS,
    INT8_GROUP_SIZES,
    OUTPUT_PROJECTION,
    WEIGHT_BITS,
    LayerQuantSpec,
    QuantPlan,
    linear_modules,
)

QUANT_FORMATS = ("int8", "int4", "fp8")


def resolve_format(fmt: str, candidates: Sequence[str], strict: bool, device: str = "cpu") -> str:
    """``fmt`` itself when this device runs it fast, else the nearest candidate by weight width (the
    notes' clampBitwidth) with a warning naming both; ``strict`` raises listing the candidates."""
    if fmt in candidates:
        return fmt
    usable = [c for c in candidates if c in QUANT_FORMATS] or list(candidates)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        chosen = clamp_bits(WEIGHT_BITS[fmt], usable)
    listing = ", ".join(f"{c} ({WEIGHT_BITS[c]} bits)" for c in candidates)
    message = f"{fmt} has no fast kernel on {device}; nearest candidate is {chosen}. Candidates: {listing}"
    if strict:
        raise ValueError(message)
    warnings.warn(message, stacklevel=3)
    return chosen


def fitted_spec(linear: nn.Linear, spec: LayerQuantSpec) -> LayerQuantSpec:
    """``spec`` as ``linear`` can store it: an int4 group that does not divide its width becomes the largest
    group that does (int8 if none); grouped int8 whose shape the block GEMM's tiles do not fit, per channel."""
    if spec.format == "int8" and spec.group_size:
        fits = linear.in_features % spec.group_size == 0 and packable(
            (linear.out_features, linear.in_features)
        )
        return spec if fits else LayerQuantSpec("int8", clip_ratio=spec.clip_ratio)
    if spec.format != "int4" or spec.group_size in int4_groups(linear.in_features, linear.out_features):
        return spec
    groups = [g for g in int4_groups(linear.in_features, linear.out_features) if g < spec.group_size]
    if not groups:
        return LayerQuantSpec("int8")
    return dataclasses.replace(spec, group_size=max(groups))


def uniform_plan(model: nn.Module, spec: LayerQuantSpec) -> QuantPlan:
    """``spec`` for every linear; int4 layers whose width the group does not divide get the largest group
    that does (then int8 if none), as exact-name exceptions before the ``_default``."""
    rules: dict[str, LayerQuantSpec] = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and fitted_spec(m, spec) != spec:
            rules[name] = fitted_spec(m, spec)
    return QuantPlan({**rules, "_default": spec})


def format_spec(fmt: str, config: QuantConfig) -> LayerQuantSpec:
    """The spec ``config`` gives format ``fmt``: int4 with its group, symmetry and scale bits; int8 in groups of 32 with
    ``granularity: per_group`` (GGUF's Q8_0 form), else per output channel."""
    if fmt == "int4":
        return LayerQuantSpec(fmt, config.group_size, config.symmetric, scale_bits=config.int4_scale_bits)
    if fmt == "int8" and config.granularity == "per_group":
        return LayerQuantSpec(fmt, INT8_GROUP_SIZES[0])
    return LayerQuantSpec(fmt)


def output_format(config: QuantConfig, body_format: str | None) -> str | None:
    """The output projection's format in a uniform plan whose other linears are ``body_format`` (None: not
    quantized): ``config.lm_head_precision``, or with "auto" int8 under int4 and the body's format otherwise."""
    if config.lm_head_precision != "auto":
        return config.lm_head_precision
    return "int8" if body_format == "int4" else body_format


def with_output(
    model: nn.Module,
    plan: QuantPlan,
    fmt: str | None,
    config: QuantConfig,
    formats: Sequence[str],
    grouped_int8: bool = False,
) -> QuantPlan:
    """``plan`` with the output projection (``OUTPUT_PROJECTION``) stored as ``fmt`` (resolved against this
    device's candidate ``formats``; int4 with the config's group and symmetry), as an exact-name rule first.
    ``grouped_int8`` (the caller's: the body is int4 and the device runs int8 in groups of 32, the block GEMM):
    the int8 that "auto" gives the output is grouped, Q8_0's form, as llama.cpp keeps its output (it holds a
    tied Q8_0 table exactly; per channel re-quantizes it)."""
    head = dict(linear_modules(model)).get(OUTPUT_PROJECTION)
    if fmt is None or not isinstance(head, nn.Linear):
        return plan
    if fmt not in DENSE_FORMATS:
        fmt = resolve_format(fmt, formats, config.strict)
    spec = format_spec(fmt, config)
    if grouped_int8 and config.lm_head_precision == "auto" and spec == LayerQuantSpec("int8"):
        spec = LayerQuantSpec("int8", INT8_GROUP_SIZES[0])
    rules = plan.to_dict()
    rules.pop(OUTPUT_PROJECTION, None)
    return QuantPlan({OUTPUT_PROJECTION: fitted_spec(head, spec), **rules})


def uniform_result(
    model: nn.Module, config: QuantConfig, formats: Sequence[str], grouped_int8: bool = False
) -> DQGResult:
    """Every linear in the target format (none when it is not a quantized one), the output projection as
    ``output_format`` says (``grouped_int8``: the device runs int8 in groups of 32, which an int4 body's int8
    output then takes, ``with_output``)."""
    body = None
    plan = QuantPlan({})
    if config.target_precision in QUANT_FORMATS:
        body = resolve_format(config.target_precision, formats, config.strict)
        plan = uniform_plan(model, format_spec(body, config))
    head = output_format(config, body)
    plan = with_output(model, plan, head, config, formats, grouped_int8 and body == "int4")
    target = f"uniform {config.target_precision}" if body else f"unquantized {config.target_precision}"
    head_spec = plan.spec_for(OUTPUT_PROJECTION)
    head_name = (
        head_spec.describe() if head == "int8" and head_spec is not None else head
    )  # "int8 g32" when grouped
    return DQGResult("uniform", plan, budget=target + (f", lm_head {head_name}" if head != body else ""))
