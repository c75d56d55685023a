"""Learned int4 scales (LSQ, Esser et al. 2020; OmniQuant's learnable weight clipping, Shao et al. 2024): each
group's round-to-nearest grid is the starting point, and a multiplier on its scale (and an offset on its zero
point, with zero points) is learned by gradient descent so that the layer's output on calibration inputs moves
least: loss = mean ||x Q^T - x W^T||^2 over sampled input rows, Q fake-quantized with a straight-through
estimator for the rounding (levels follow the grid as it moves, clamped to 0..15). Adam on fp32 parameters,
fp32 throughout (no loss scaler needed). The result is stored exactly as round-to-nearest's is (same groups,
levels 0..15, fp16 scales and zeros, same kernels); only the grids, and so the levels, differ.

Layer after layer like ``quant.gptq``: a decoder layer's linears learn on the inputs they see with every earlier
layer already quantized. Calibration samples are split: the later ``heldout_share`` of them only measure each
layer's output error before (round-to-nearest) and after (learned), and a layer keeps the learned grid only where
that held-out error drops.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from mcp2026.quant.calibrate import _progress
from mcp2026.quant.gptq import first_layer_inputs, fresh_args
from mcp2026.quant.int4_linear import Int4Linear
from mcp2026.quant.linear import build_linear, quantize_
from mcp2026.quant.method_errors import ratio_line
from mcp2026.quant.plan import DENSE_FORMATS, OUTPUT_PROJECTION, LayerQuantSpec, QuantPlan, linear_modules
from mcp2026.quant.quantizer import SCALE_DTYPE, dequantize_groupwise_int4, nearest_levels, quantize_int4

METHOD = "learned"


@dataclass(frozen=True)
class LearnedScaleSettings:
    steps: int = 30  # Adam steps per linear
    lr: float = 1e-2  # on the scale multiplier (1 + a) and the zero offset (b steps of the initial grid)
    train_rows: int = 256  # input rows per linear to learn on, sampled evenly from the training samples
    heldout_rows: int = 256  # input rows per linear from the held-out samples, for the gate
    heldout_share: float = 0.25  # share of the calibration samples held out (at least one)
    seed: int = 0

    def __post_init__(self) -> None:
        for name, low in (("steps", 1), ("train_rows", 1), ("heldout_rows", 1)):
            if getattr(self, name) < low:
                raise ValueError(f"learned.{name} must be >= {low}, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"learned.lr must be > 0, got {self.lr}")
        if not 0.0 < self.heldout_share < 1.0:
            raise ValueError(f"learned.heldout_share must be in (0, 1), got {self.heldout_share}")


@dataclass(frozen=True)
class LayerError:
    """One linear's mean squared output error on held-out calibration rows with the learned grid and with
    round-to-nearest's, and the mean squared output itself (so layers compare)."""

    learned: float
    rtn: float
    reference: float

    @property
    def ratio(self) -> float:
        return self.learned / self.rtn if self.rtn > 0 else float("nan")

    @property
    def kept_learned(self) -> bool:
        return self.learned < self.rtn


def _ste_round(x: Tensor) -> Tensor:
    return x + (torch.round(x) - x).detach()


def _fake_quantize(wg: Tensor, scale: Tensor, zero: Tensor) -> Tensor:
    """(q - 8) * scale + zero with q the nearest level in 0..15, differentiable in scale and zero (LSQ: the
    rounding passes gradients straight through, clamped levels pass none)."""
    q = torch.clamp(_ste_round((wg - zero) / scale) + 8, 0, 15)
    return (q - 8) * scale + zero


def _output_error(x: Tensor, w: Tensor, quantized: Tensor) -> float:
    return float((x @ (quantized - w).T).pow(2).mean())


def learn_grid(
    w: Tensor, spec: LayerQuantSpec, rows: Tensor, settings: LearnedScaleSettings = LearnedScaleSettings()
) -> tuple[Tensor, Tensor, Tensor]:
    """w (N, K), input rows (R, K) -> (q uint8 (N, K) in 0..15, scales (N, K/g), zeros (N, K/g)) in
    ``quantize_int4``'s convention, the grid learned from ``spec``'s round-to-nearest grid (bf16 as stored)."""
    n, k = w.shape
    g = spec.group_size
    w = w.detach().float()
    wg = w.reshape(n, k // g, g)
    _, s0, z0 = quantize_int4(w, dataclasses.replace(spec, method="rtn"))
    s0, z0 = s0.unsqueeze(-1), z0.unsqueeze(-1)  # (N, G, 1)
    multiplier = torch.zeros_like(s0, requires_grad=True)  # scale = s0 * (1 + multiplier)
    offset = torch.zeros_like(z0, requires_grad=not spec.symmetric)  # zero = z0 + offset * |s0|
    params = [multiplier, offset] if not spec.symmetric else [multiplier]
    optimizer = torch.optim.Adam(params, lr=settings.lr)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, settings.steps)
    x = rows.float()
    # The forward pass rounds exactly (only the gradient goes straight through), so each step's loss is the true
    # training loss of its parameters; STE steps are not descent steps, so the best parameters seen are kept
    # (round-to-nearest's, the zeros, to begin with).
    best = (float("inf"), multiplier.detach().clone(), offset.detach().clone())
    with torch.enable_grad():
        for _ in range(settings.steps + 1):  # the last pass only scores the final step
            optimizer.zero_grad(set_to_none=True)
            quantized = _fake_quantize(wg, s0 * (1 + multiplier), z0 + offset * s0.abs()).reshape(n, k)
            loss = (x @ (quantized - w).T).pow(2).mean()
            if loss.item() < best[0]:
                best = (loss.item(), multiplier.detach().clone(), offset.detach().clone())
            if schedule.last_epoch == settings.steps:
                break
            loss.backward()
            optimizer.step()
            schedule.step()
    with torch.no_grad():
        _, multiplier, offset = best
        scale = (s0 * (1 + multiplier)).to(SCALE_DTYPE).float()
        scale = torch.where(scale.abs() < 1e-8, s0, scale)  # a scale learned to zero: the initial one
        zero = (z0 + offset * s0.abs()).to(SCALE_DTYPE).float()
        q = nearest_levels(wg, scale, zero)
    return q.reshape(n, k), scale.squeeze(-1), zero.squeeze(-1)


def learned_module(
    name: str, linear: nn.Linear, spec: LayerQuantSpec, train: Tensor, heldout: Tensor, dtype,
    settings: LearnedScaleSettings,
) -> tuple[Int4Linear, LayerError]:  # fmt: skip
    """The layer with its learned grid, or round-to-nearest's where that has the lower (or equal) output error on
    the held-out rows (weights already on a grid: rounding gives them back exactly)."""
    w = linear.weight.detach().float()
    g = spec.group_size
    learned = learn_grid(w, spec, train, settings)
    rounded = quantize_int4(w, dataclasses.replace(spec, method="rtn"))
    error = LayerError(
        _output_error(heldout, w, dequantize_groupwise_int4(*learned, g)),
        _output_error(heldout, w, dequantize_groupwise_int4(*rounded, g)),
        float((heldout @ w.T).pow(2).mean()),
    )
    try:
        module = Int4Linear.from_levels(linear, spec, *(learned if error.kept_learned else rounded), dtype)
    except ValueError as problem:
        raise ValueError(f"{name}: {problem}") from problem
    return module, error


class _Rows:
    """Up to ``per_call`` random input rows of each call per linear, train and held-out calls kept apart."""

    def __init__(self, per_call: tuple[int, int], seed: int) -> None:
        self.per_call = per_call
        self.generator = torch.Generator().manual_seed(seed)
        self.rows: dict[tuple[str, bool], list[Tensor]] = {}
        self.heldout = False  # whether the calls now running are held-out samples

    def add(self, name: str, x: Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1])
        take = torch.randperm(x.shape[0], generator=self.generator)[: self.per_call[self.heldout]]
        self.rows.setdefault((name, self.heldout), []).append(x[take.to(x.device)].float().cpu())

    def get(self, name: str, heldout: bool) -> Tensor:
        return torch.cat(self.rows[(name, heldout)])


def _split(count: int, settings: LearnedScaleSettings) -> int:
    """How many of ``count`` samples train (the rest are held out); an error when one side would be empty."""
    heldout = max(1, round(count * settings.heldout_share))
    if count - heldout < 1:
        raise ValueError(
            f"learned scales need >= 2 calibration samples (one to learn on, one held out), got {count}"
        )
    return count - heldout


def _per_call(count: int, train: int, settings: LearnedScaleSettings) -> tuple[int, int]:
    return math.ceil(settings.train_rows / train), math.ceil(settings.heldout_rows / (count - train))


def _collect(
    modules: Mapping[str, nn.Module], calls: Sequence, run, train: int, per_call: tuple[int, int], seed: int
) -> _Rows:
    """Rows of each of ``modules`` while ``run(call)`` runs every call (the first ``train`` are training ones)."""
    rows = _Rows(per_call, seed)
    handles = [m.register_forward_pre_hook(lambda _m, a, n=n: rows.add(n, a[0])) for n, m in modules.items()]
    try:
        for i, call in enumerate(calls):
            rows.heldout = i >= train
            run(call)
    finally:
        for handle in handles:
            handle.remove()
    return rows


def quantize_sequential(
    model: nn.Module,
    plan: QuantPlan,
    samples: Sequence[Tensor],
    tensors: Mapping[str, Tensor] | None = None,
    compute_dtypes: Mapping[str, torch.dtype] | None = None,
    settings: LearnedScaleSettings = LearnedScaleSettings(),
    progress: bool = True,
) -> dict[str, LayerError]:
    """Quantize ``model`` in place as ``plan`` says, one decoder layer after another; its "learned" int4 linears
    learn their grids on the inputs they see with every earlier layer already quantized, the others are quantized
    as ``quantize_`` does. A learned output projection gets the final hidden states of the quantized body.
    ``samples``: token id sequences of calibration text (the later ``heldout_share`` only gate). Returns each
    learned linear's held-out output error beside round-to-nearest's."""
    names = {id(m): n for n, m in model.named_modules()}
    pending = {n for n, _ in linear_modules(model) if is_learned(plan.spec_for(n))}
    train = _split(len(samples), settings)
    per_call = _per_call(len(samples), train, settings)
    errors: dict[str, LayerError] = {}
    with torch.no_grad(), _progress(progress) as bar:
        task = bar.add_task("learning int4 scales", total=len(model.layers) + 1)
        inputs = first_layer_inputs(model, samples) if pending else []
        for index, layer in enumerate(model.layers):
            prefix = names[id(layer)]
            linears = {f"{prefix}.{n}": m for n, m in linear_modules(layer) if isinstance(m, nn.Linear)}
            learned = {n: m for n, m in linears.items() if n in pending}
            rows = None
            if learned:
                run = lambda call, layer=layer: layer(*fresh_args(call[0]), **call[1])  # noqa: E731
                rows = _collect(learned, inputs, run, train, per_call, settings.seed + index)
            for name, linear in linears.items():
                errors.update(_replace(model, name, linear, plan.spec_for(name), rows, tensors, compute_dtypes,
                                       settings))  # fmt: skip
            pending -= set(learned)
            if pending:  # the next layer's inputs, through this layer as quantized
                inputs = [((*layer(*fresh_args(a), **kw), *a[2:]), kw) for a, kw in inputs]
            bar.advance(task)
        for name in sorted(pending):
            if name != OUTPUT_PROJECTION:
                raise ValueError(
                    f"{name}: learned scales run on the decoder layers' linears and the output projection only"
                )
            rows = _head_rows(model, name, samples, train, per_call, settings.seed + len(model.layers))
            linear = model.get_submodule(name)
            errors.update(
                _replace(model, name, linear, plan.spec_for(name), rows, tensors, compute_dtypes, settings)
            )
        bar.advance(task)
    quantize_(model, plan, tensors, compute_dtypes)  # what is left: linears outside the layers, not learned
    return errors


def _head_rows(model: nn.Module, name: str, samples, train: int, per_call, seed: int) -> _Rows:
    """Rows of the output projection's input: the model's final hidden states (what ``model()`` returns)."""
    device = next(model.parameters()).device
    rows = _Rows(per_call, seed)
    for i, ids in enumerate(samples):
        rows.heldout = i >= train
        rows.add(name, model(ids.to(device), torch.arange(len(ids), device=device)))
    return rows


def _replace(model, name, linear, spec, rows, tensors, compute_dtypes, settings) -> dict[str, LayerError]:
    """Put ``name``'s quantized module in place (learned with ``rows``, else as ``quantize_`` would)."""
    if spec is None or (
        spec.format in DENSE_FORMATS and Int4Linear.dtype_of(spec.format) == linear.weight.dtype
    ):
        return {}
    dtype = compute_dtypes.get(spec.format) if compute_dtypes else None
    errors = {}
    if is_learned(spec):
        train, heldout = rows.get(name, False), rows.get(name, True)
        module, errors[name] = learned_module(name, linear, spec, train, heldout, dtype, settings)
    else:
        module = build_linear(name, linear, spec, dtype, tensors)
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, module)
    return errors


def is_learned(spec: LayerQuantSpec | None) -> bool:
    return spec is not None and spec.method == METHOD


def uses_learned(plan: QuantPlan, model: nn.Module) -> bool:
    """Whether some linear of ``model`` gets a learned-scales spec from ``plan``."""
    return any(is_learned(spec) for spec in plan.layer_specs(model).values())


def summary(errors: Mapping[str, LayerError]) -> str:
    """One line: how many linears learned their scales and the held-out output error against round-to-nearest's."""
    if not errors:
        return "learned scales: no linear quantized"
    kept = sum(e.kept_learned for e in errors.values())
    return (
        f"learned scales: {len(errors)} linears; held-out output error vs round-to-nearest: "
        + ratio_line((e.learned, e.rtn) for e in errors.values())
        + f"; {kept} kept the learned grid, {len(errors) - kept} round-to-nearest's"
    )


def per_layer(errors: Mapping[str, LayerError]) -> str:
    """Each linear's held-out relative output error before -> after (the kept one after)."""
    cells = [
        f"{name} {e.rtn / e.reference:.3g} -> {min(e.learned, e.rtn) / e.reference:.3g}"
        for name, e in errors.items()
        if e.reference > 0
    ]
    return "learned scales per layer, held-out relative output error round-to-nearest -> kept: " + "; ".join(
        cells
    )
