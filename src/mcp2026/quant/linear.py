"""Quantized linears by weight format (a registry: one ``QuantLinear`` module per format), and building them:
one linear from its spec, or every linear of a model from a plan.

Each module's forward is a real kernel: our CPU GEMVs at decode sizes (``kernels/gemv.cpp``), our int4 /
int8 GEMMs on AVX-512 VNNI CPUs, dequantize + oneDNN GEMM for prefill on CPUs without fast bf16, else torch's
(``aten._weight_int8pack_mm``, ``aten._weight_int4pack_mm_for_cpu``, ``torch._scaled_mm``, ``F.linear``), plus
dtype casts when its ``compute_dtype`` differs from the input's (``cpu_routing`` picks by row count).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor, nn

from mcp2026.quant.dense_linear import DenseLinear
from mcp2026.quant.fp8_linear import Fp8Linear
from mcp2026.quant.int4_linear import Int4Linear
from mcp2026.quant.int8_group_linear import Int8GroupLinear
from mcp2026.quant.int8_linear import Int8Linear
from mcp2026.quant.plan import DENSE_FORMATS, LayerQuantSpec, linear_modules
from mcp2026.quant.quant_linear import QuantLinear, has_bias
from mcp2026.quant.split_rows_linear import SplitRowsLinear

LINEAR_FORMATS: dict[str, type[QuantLinear]] = {
    fmt: cls for cls in (DenseLinear, Int8Linear, Int4Linear, Fp8Linear) for fmt in cls.formats
}


def linear_class(spec: LayerQuantSpec) -> type[QuantLinear]:
    """The module that stores ``spec``: its format's, ``SplitRowsLinear`` for a split int4 spec,
    ``Int8GroupLinear`` for int8 with a group size."""
    if spec.format == "int8" and spec.group_size:
        return Int8GroupLinear
    return SplitRowsLinear if spec.high_rows else LINEAR_FORMATS[spec.format]


def empty_module(linear: nn.Linear, spec: LayerQuantSpec, compute_dtype: torch.dtype) -> QuantLinear:
    """An unfilled module shaped for ``spec`` (an artifact's state dict fills it)."""
    return linear_class(spec)(
        linear.in_features, linear.out_features, spec, has_bias(linear, spec), compute_dtype
    )


def build_linear(
    name: str,
    linear: nn.Linear,
    spec: LayerQuantSpec,
    compute_dtype: torch.dtype | None = None,
    tensors: Mapping[str, Tensor] | None = None,
) -> QuantLinear:
    """Quantize one linear as ``spec`` says, taking the calibration tensors its spec names from ``tensors``
    (AWQ scales, row scores, mean inputs); a missing one is an error that names it."""
    found = {}
    for field, key in (("act_scale", spec.act_scale), ("row_scores", spec.row_scores),
                       ("input_mean", spec.bias_correction)):  # fmt: skip
        if key is not None:
            if tensors is None or key not in tensors:
                raise KeyError(
                    f"{name}: the plan names tensor {key!r} ({field}), not among the tensors passed"
                )
            found[field] = tensors[key]
    try:
        return linear_class(spec).from_linear(
            linear, spec, compute_dtype, found.pop("act_scale", None), **found
        )
    except ValueError as error:
        raise ValueError(f"{name}: {error}") from error


def quantize_(
    model: nn.Module,
    plan,
    tensors: Mapping[str, Tensor] | None = None,
    compute_dtypes: Mapping[str, torch.dtype] | Callable[[str], torch.dtype | None] | None = None,
) -> nn.Module:
    """Replace the model's nn.Linear submodules in place as ``plan.spec_for(name)`` says.

    Layers with no spec, or a dense spec of the dtype they already have, stay untouched.
    ``tensors``: name -> calibration tensor, for specs that name one (``act_scale``, ``row_scores``,
    ``bias_correction``; the DQG's result carries them).
    ``compute_dtypes``: format -> dtype the kernel runs in (pass ``backend.probe().compute_dtypes`` for
    the measured fastest); default: the layer's own weight dtype.
    """
    lookup = compute_dtypes.get if isinstance(compute_dtypes, Mapping) else compute_dtypes
    for name, linear in list(linear_modules(model)):
        spec = plan.spec_for(name)
        if not isinstance(linear, nn.Linear) or spec is None:
            continue
        if spec.format in DENSE_FORMATS and QuantLinear.dtype_of(spec.format) == linear.weight.dtype:
            continue
        module = build_linear(name, linear, spec, lookup and lookup(spec.format), tensors)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, module)
    return model
