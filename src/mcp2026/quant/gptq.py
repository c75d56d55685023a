"""GPTQ (Frantar et al., "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained Transformers",
2022): int4 levels that minimise a linear's output error ||X W^T - X Q^T||^2 on calibration inputs X rather
than each weight's own error. Columns are rounded one at a time and each column's rounding error is spread
over the columns not yet rounded through the inverse of H = 2 X^T X / n (the Optimal Brain Surgeon update).
The result is stored exactly as round-to-nearest's is (same groups, grids and kernels); only the levels differ.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from mcp2026.quant.calibrate import _progress
from mcp2026.quant.dqg_options import role_of
from mcp2026.quant.int4_linear import Int4Linear
from mcp2026.quant.linear import build_linear, quantize_
from mcp2026.quant.method_errors import ratio_line
from mcp2026.quant.plan import (
    DEFAULT_KEY,
    DENSE_FORMATS,
    OUTPUT_PROJECTION,
    SCALE_BITS,
    LayerQuantSpec,
    QuantPlan,
    linear_modules,
)
from mcp2026.quant.quant_linear import QuantLinear
from mcp2026.quant.quantizer import (
    correction_bias,
    dequantize_groupwise_int4,
    grid_exponents,
    nearest_levels,
    quantize_int4,
)

_DAMP_RETRIES = 4  # each retry multiplies the damping by 10 when H + damping is still not positive definite


@dataclass(frozen=True)
class GPTQSettings:
    damp: float = 0.01  # added to H's diagonal as a share of its mean (GPTQ's percdamp): H stays invertible
    block_size: int = 128  # columns per lazy batch update (GPTQ's blocksize); a multiple of every int4 group
    # In the Hessian of a qkv projection a sample's first token counts once per token of the sample: every later
    # position attends to it (the attention sink), so an error in its keys and values reaches all of them.
    # Counted once like any token, GPTQ leaves it more error than rounding to nearest does, which on SmolLM2
    # costs more than GPTQ saves elsewhere. (Other linears count it once: with its massive activations, weighting
    # it there moves error onto every other token.)
    weight_first_token: bool = True
    # Columns in order of decreasing H diagonal (GPTQ's act-order), with each group's grid fixed beforehand
    # from the unrounded weights (its "static groups"), so that groups stay runs of g consecutive columns.
    act_order: bool = False

    def __post_init__(self) -> None:
        if not 0.0 < self.damp <= 1.0:
            raise ValueError(f"gptq.damp must be in (0, 1], a share of H's mean diagonal; got {self.damp}")
        if self.block_size < 128 or self.block_size % 128:
            raise ValueError(
                f"gptq.block_size must be a multiple of 128 (every int4 group), got {self.block_size}"
            )


class HessianAccumulator:
    """x x^T summed over every input row a linear sees, each row with a weight (1 unless given):
    ``hessian()`` = 2 X^T diag(weights) X / sum(weights), GPTQ's H with weighted tokens."""

    def __init__(self, in_features: int) -> None:
        self.total = torch.zeros(in_features, in_features)
        self.total_weight = 0.0

    def add(self, x: Tensor, first_row_weight: float = 1.0) -> None:
        """The rows of ``x`` (..., K), the first one counted ``first_row_weight`` times."""
        rows = x.detach().reshape(-1, self.total.shape[0]).float().cpu()  # (T, K)
        if first_row_weight != 1.0 and len(rows):
            rows = torch.cat([rows[:1] * first_row_weight**0.5, rows[1:]])
        self.total.addmm_(rows.T, rows)
        self.total_weight += rows.shape[0] - 1 + first_row_weight if len(rows) else 0.0

    def hessian(self) -> Tensor:
        return self.total * (2.0 / max(self.total_weight, 1e-30))


def _inverse_cholesky(hessian: Tensor, damp: float) -> Tensor:
    """Upper Cholesky factor of (H + damping)^-1: row i holds what rounding column i does to columns > i."""
    h = hessian.clone()
    dead = h.diagonal() == 0  # inputs that were always zero: their weights are rounded, nothing spreads
    h[dead, dead] = 1.0
    eye = torch.eye(h.shape[0])
    for attempt in range(_DAMP_RETRIES):
        factor, info = torch.linalg.cholesky_ex(h + damp * 10**attempt * h.diagonal().mean() * eye)
        if info == 0:
            return torch.linalg.cholesky(torch.cholesky_inverse(factor), upper=True)
    raise ValueError(
        f"GPTQ: H + {damp * 10 ** (_DAMP_RETRIES - 1):g} x mean(diag H) is not positive definite"
    )


def gptq_int4(
    w: Tensor, hessian: Tensor, spec: LayerQuantSpec, settings: GPTQSettings = GPTQSettings()
) -> tuple[Tensor, Tensor, Tensor]:
    """w (N, K), H (K, K) -> (q uint8 (N, K) in 0..15, scales (N, K/g), zeros (N, K/g)) in
    ``quantize_int4``'s convention. Each group's grid is chosen as ``spec`` chooses it (min/max or peak,
    ``clip_ratio``, the "mse" search) from the group's weights as they stand when its first column is reached,
    i.e. after the errors of earlier columns were spread into them (GPTQ's own order); with act-order, from
    the unrounded weights."""
    n, k = w.shape
    g = spec.group_size
    if k % g:
        raise ValueError(f"int4 group size {g} must divide in_features={k}")
    weights = w.detach().float().clone()
    order = torch.argsort(hessian.diagonal(), descending=True, stable=True) if settings.act_order else None
    static = quantize_int4(weights, spec)[1:] if order is not None else None  # (N, K/g) each
    # 8-bit grids: each row's code steps fixed beforehand from its round-to-nearest grids, as groups come one by one
    exponents = None
    if spec.scale_bits != SCALE_BITS:
        exponents = grid_exponents(
            *quantize_int4(weights, dataclasses.replace(spec, scale_bits=SCALE_BITS))[1:]
        )
    if order is not None:
        weights, hessian = weights[:, order], hessian[order][:, order]
    inverse = _inverse_cholesky(hessian.float(), settings.damp)
    q = torch.zeros(n, k, dtype=torch.uint8)
    scales, zeros = torch.zeros(n, k // g), torch.zeros(n, k // g)
    for start in range(0, k, settings.block_size):
        end = min(start + settings.block_size, k)
        block = weights[:, start:end].clone()  # (N, B): updated in place as columns are rounded
        errors = torch.zeros_like(block)
        local = inverse[start:end, start:end]
        for i in range(end - start):
            column = start + i
            if static is not None:
                group = int(order[column]) // g
                scale, zero = static[0][:, group : group + 1], static[1][:, group : group + 1]
            elif column % g == 0:  # a new group: its grid from its weights as they are now
                _, scale, zero = quantize_int4(block[:, i : i + g], spec, exponents)  # (N, 1) each
                scales[:, column // g], zeros[:, column // g] = scale[:, 0], zero[:, 0]
            level = nearest_levels(block[:, i : i + 1], scale, zero)  # (N, 1)
            q[:, column] = level[:, 0]
            error = (block[:, i] - ((level.float() - 8) * scale + zero)[:, 0]) / local[i, i]  # (N,)
            block[:, i:] -= error.unsqueeze(1) * local[i, i:].unsqueeze(0)
            errors[:, i] = error
        weights[:, end:] -= errors @ inverse[start:end, end:]
    if order is not None:
        q = q[:, torch.argsort(order)]
        scales, zeros = static
    return q, scales, zeros


def output_error(w: Tensor, quantized: Tensor, hessian: Tensor) -> float:
    """Mean over calibration rows (weighted as H weights them) of ||x (W - Q)^T||^2: tr(D H D^T) / 2."""
    d = quantized.float() - w.float()  # (N, K)
    return float(((d @ hessian) * d).sum() / 2)


@dataclass(frozen=True)
class LayerError:
    """One GPTQ linear's output error on its calibration inputs, round-to-nearest's on the same inputs, and
    which of the two levels the layer kept (the lower error's)."""

    gptq: float
    rtn: float
    reference: float  # mean ||x W^T||^2: the errors relative to it are comparable between layers

    @property
    def ratio(self) -> float:
        return self.gptq / self.rtn if self.rtn > 0 else float("nan")

    @property
    def kept_gptq(self) -> bool:
        return self.gptq <= self.rtn


def _gptq_module(
    name: str,
    linear: nn.Linear,
    spec: LayerQuantSpec,
    hessian: Tensor,
    dtype,
    settings: GPTQSettings,
    tensors: Mapping[str, Tensor] | None = None,
) -> tuple[QuantLinear, LayerError]:
    """The layer with GPTQ's levels, or round-to-nearest's where those have the lower output error on the
    calibration inputs (weights already on a grid of this layout: rounding gives them back, GPTQ's error feedback
    moves them off it)."""
    if spec.high_rows:
        return _gptq_split_module(name, linear, spec, hessian, dtype, settings, tensors)
    w = linear.weight.detach()
    levels = gptq_int4(w, hessian, spec, settings)
    rounded = quantize_int4(w, dataclasses.replace(spec, method="rtn"))
    g = spec.group_size
    error = LayerError(
        output_error(w, dequantize_groupwise_int4(*levels, g), hessian),
        output_error(w, dequantize_groupwise_int4(*rounded, g), hessian),
        output_error(w, torch.zeros_like(w, dtype=torch.float32), hessian),
    )
    try:
        return Int4Linear.from_levels(linear, spec, *(levels if error.kept_gptq else rounded), dtype), error
    except ValueError as problem:
        raise ValueError(f"{name}: {problem}") from problem


def _gptq_split_module(
    name, linear, spec, hessian, dtype, settings, tensors
) -> tuple[QuantLinear, LayerError]:
    """A split layer (``high_rows``): its rows as round-to-nearest splits them, the int4 rows' levels by GPTQ (rows
    are independent under GPTQ: each is rounded against the same H), kept where the layer's output error is lower;
    a correction bias is computed from the weights as finally stored."""
    w = linear.weight.detach()
    module = build_linear(name, linear, dataclasses.replace(spec, method="rtn"), dtype, tensors)
    rounded = module.dequantize()
    low_rows = module._low_rows(module.high_index.long())
    rounded_low = {key: t.clone() for key, t in module.low.state_dict().items()}
    module.low._store(*gptq_int4(w[low_rows], hessian, module.low.spec, settings))
    error = LayerError(
        output_error(w, module.dequantize(), hessian),
        output_error(w, rounded, hessian),
        output_error(w, torch.zeros_like(w, dtype=torch.float32), hessian),
    )
    if not error.kept_gptq:
        module.low.load_state_dict(rounded_low)  # build_linear's correction bias fits these weights
    elif spec.bias_correction is not None:  # build_linear checked that the mean input is among the tensors
        correction = correction_bias(w, module.dequantize(), tensors[spec.bias_correction])
        own = linear.bias.detach().float() if linear.bias is not None else 0.0
        module.bias = (correction + own).to(module.compute_dtype)
    module.spec = spec
    return module.to(w.device), error


class _FirstLayerInputs(Exception):
    """Raised by the hook on the first decoder layer once it has its inputs: the rest of the pass is not needed."""


def first_layer_inputs(model: nn.Module, samples: Sequence[Tensor]) -> list[tuple[tuple, dict]]:
    """(args, kwargs) of ``model.layers[0]`` for each sample, the model run as far as that layer."""
    captured: list[tuple[tuple, dict]] = []

    def catch(_module, args, kwargs):
        captured.append((args, kwargs))
        raise _FirstLayerInputs

    handle = model.layers[0].register_forward_pre_hook(catch, with_kwargs=True)
    device = next(model.parameters()).device
    try:
        for ids in samples:
            with contextlib.suppress(_FirstLayerInputs):
                model(ids.to(device), torch.arange(len(ids), device=device))
    finally:
        handle.remove()
    return captured


def fresh_args(args: tuple) -> tuple:
    """A layer call's arguments with its tensors copied: the fused add + norm updates the residual stream in
    place, and the stored inputs are run through a layer twice (for the Hessians, then for the outputs)."""
    return tuple(a.clone() if isinstance(a, Tensor) else a for a in args)


def _hessians(
    layer: nn.Module,
    inputs: Sequence[tuple[tuple, dict]],
    modules: Mapping[str, nn.Module],
    weight_first_token: bool,
) -> dict[str, Tensor]:
    """H of each of ``modules`` (linears inside ``layer``) over what they see while ``layer`` runs on ``inputs``
    (one sample per call; its first row weighted by the sample's length when ``weight_first_token``)."""
    sums = {name: HessianAccumulator(m.in_features) for name, m in modules.items()}

    def add(name: str, x: Tensor) -> None:
        rows = x.reshape(-1, x.shape[-1])
        is_kv = role_of(name) == "attn_qkv"
        sums[name].add(rows, float(len(rows)) if weight_first_token and is_kv else 1.0)

    handles = [m.register_forward_pre_hook(lambda _m, a, n=n: add(n, a[0])) for n, m in modules.items()]
    try:
        for args, kwargs in inputs:
            layer(*fresh_args(args), **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return {name: s.hessian() for name, s in sums.items()}


def quantize_sequential(
    model: nn.Module,
    plan: QuantPlan,
    samples: Sequence[Tensor],
    tensors: Mapping[str, Tensor] | None = None,
    compute_dtypes: Mapping[str, torch.dtype] | None = None,
    settings: GPTQSettings = GPTQSettings(),
    progress: bool = True,
) -> dict[str, LayerError]:
    """Quantize ``model`` in place as ``plan`` says, one decoder layer after another: the Hessians of a layer's
    GPTQ linears come from its inputs with every earlier layer already quantized (GPTQ's sequential order, so
    a layer also corrects what the layers before it lost); its other linears are quantized as ``quantize_``
    does. A GPTQ output projection gets the final hidden states of the quantized body. ``samples``: token id
    sequences of calibration text. Returns each GPTQ linear's output error beside round-to-nearest's."""
    names = {id(m): n for n, m in model.named_modules()}
    pending = {n for n, _ in linear_modules(model) if _is_gptq(plan.spec_for(n))}
    errors: dict[str, LayerError] = {}
    with torch.no_grad(), _progress(progress) as bar:
        task = bar.add_task("GPTQ", total=len(model.layers) + 1)
        inputs = first_layer_inputs(model, samples) if pending else []
        for layer in model.layers:
            prefix = names[id(layer)]
            linears = {f"{prefix}.{n}": m for n, m in linear_modules(layer) if isinstance(m, nn.Linear)}
            gptq = {n: m for n, m in linears.items() if n in pending}
            hessians = _hessians(layer, inputs, gptq, settings.weight_first_token) if gptq else {}
            for name, linear in linears.items():
                errors.update(_replace(model, name, linear, plan.spec_for(name), hessians.get(name), tensors,
                                       compute_dtypes, settings))  # fmt: skip
            pending -= set(gptq)
            if pending:  # the next layer's inputs, through this layer as quantized
                inputs = [((*layer(*fresh_args(a), **kw), *a[2:]), kw) for a, kw in inputs]
            bar.advance(task)
        for name in sorted(pending):
            if name != OUTPUT_PROJECTION:
                raise ValueError(
                    f"{name}: GPTQ runs on the decoder layers' linears and the output projection only"
                )
            linear = model.get_submodule(name)
            hessian = _output_hessian(model, linear.in_features, samples)
            errors.update(
                _replace(model, name, linear, plan.spec_for(name), hessian, tensors, compute_dtypes, settings)
            )
        bar.advance(task)
    quantize_(model, plan, tensors, compute_dtypes)  # what is left: linears outside the layers, not GPTQ
    return errors


def _output_hessian(model: nn.Module, in_features: int, samples: Sequence[Tensor]) -> Tensor:
    """H of the output projection: its input is the model's final hidden state (what ``model()`` returns)."""
    device = next(model.parameters()).device
    total = HessianAccumulator(in_features)
    for ids in samples:
        total.add(model(ids.to(device), torch.arange(len(ids), device=device)))
    return total.hessian()


def as_gptq(plan: QuantPlan, method: str = "gptq") -> QuantPlan:
    """``plan`` with its int4 specs' levels chosen by GPTQ (every one without an AWQ scale: split rows and bias
    correction included), or by "learned" scales (plain int4 on fp16 grids only)."""
    rules = [*plan.rules, *([(DEFAULT_KEY, plan.default)] if plan.default is not None else [])]
    return QuantPlan({pattern: _method_spec(spec, method) for pattern, spec in rules})


def _method_spec(spec: LayerQuantSpec, method: str) -> LayerQuantSpec:
    if method == "gptq":  # split rows too (their int4 rows), and a correction bias from GPTQ's weights
        plain = spec.format == "int4" and spec.act_scale is None
    else:  # learned scales: plain int4 on fp16 grids
        plain = (
            spec.format == "int4"
            and not spec.high_rows
            and spec.act_scale is None
            and spec.bias_correction is None
            and spec.scale_bits == SCALE_BITS
        )
    return dataclasses.replace(spec, method=method) if plain else spec


def uses_gptq(plan: QuantPlan, model: nn.Module) -> bool:
    """Whether some linear of ``model`` gets a GPTQ spec from ``plan``."""
    return any(_is_gptq(spec) for spec in plan.layer_specs(model).values())


def summary(errors: Mapping[str, LayerError]) -> str:
    """One line: how many linears GPTQ quantized and their output error against round-to-nearest's."""
    if not errors:
        return "GPTQ: no linear quantized"
    rounded = sum(not e.kept_gptq for e in errors.values())
    return (
        f"GPTQ: {len(errors)} linears; output error on calibration inputs vs round-to-nearest: "
        + ratio_line((e.gptq, e.rtn) for e in errors.values())
        + (f"; {rounded} kept round-to-nearest's lower-error levels" if rounded else "")
    )


def _is_gptq(spec: LayerQuantSpec | None) -> bool:
    return spec is not None and spec.method == "gptq"


def _replace(model, name, linear, spec, hessian, tensors, compute_dtypes, settings) -> dict[str, LayerError]:
    """Put ``name``'s quantized module in place (GPTQ with ``hessian``, else as ``quantize_`` would)."""
    if spec is None or (
        spec.format in DENSE_FORMATS and Int4Linear.dtype_of(spec.format) == linear.weight.dtype
    ):
        return {}
    dtype = compute_dtypes.get(spec.format) if compute_dtypes else None
    errors = {}
    if _is_gptq(spec):
        module, errors[name] = _gptq_module(name, linear, spec, hessian, dtype, settings, tensors)
    else:
        module = build_linear(name, linear, spec, dtype, tensors)
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, module)
    return errors
