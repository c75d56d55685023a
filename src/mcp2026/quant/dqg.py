"""Dynamic Quantization Gate: choose a weight format per linear layer from measurements.

Analytic mode: ``b* = ceil(log2(1 + sigma/eps))`` per layer, clamped to the backend's candidate formats.
Measured mode: for each layer and candidate spec (int8, int4 g32/64/128 symmetric or with zero points on fp16 or
8-bit grids, plus pre-compensated variants: zero point, MSE clipping, AWQ scaling) the output error on
calibration rows (``dqg_options``), an estimate of the KL divergence it adds; then the plan minimising the
summed error under a budget, by a greedy walk over each layer's lower convex hull of (cost, error) - the
Lagrangian knapsack solution - plus a final fill. ``DQGResult`` holds the plan and how it was chosen.
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from rich.table import Table
from torch import Tensor, nn

from mcp2026.errors import MCPError
from mcp2026.quant.backend import clamp_bits
from mcp2026.quant.calibrate import Calibration, _progress
from mcp2026.quant.dqg_options import (
    DQGSettings,
    LayerOptions,
    Option,
    int4_groups,
    layer_options,
    tied_linears,
)
from mcp2026.quant.plan import DENSE_FORMATS, SCALE_BITS, LayerQuantSpec, QuantPlan


class BudgetError(MCPError, ValueError):
    """A budget no plan over the candidate formats can meet."""


def measure_options(
    model: nn.Module,
    calib: Calibration,
    formats: Sequence[str],
    settings: DQGSettings = DQGSettings(),
    progress: bool = True,
) -> dict[str, LayerOptions]:
    """Every candidate spec's measured error for every calibrated nn.Linear (the expensive part)."""
    tied = tied_linears(model)
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n in calib.layers]
    result = {}
    with torch.inference_mode(), _progress(progress) as bar:
        task = bar.add_task("measuring formats", total=len(names))
        for name in names:
            result[name] = layer_options(
                name, model.get_submodule(name), calib, formats, settings, name in tied
            )
            bar.advance(task)
    return result


# ---- allocation ------------------------------------------------------------------------------------
def _cost(layer: LayerOptions, option: Option, unit: str) -> float:
    """Cost in bits (unit "bits") or bytes; keeping a tied layer dense costs no bytes (shared storage)."""
    if unit == "bits":
        return layer.numel * option.bits
    if layer.is_tied and option.spec.format in DENSE_FORMATS:
        return 0.0
    return layer.numel * option.bits / 8


def _hull(points: list[tuple[float, float, Option]]) -> list[tuple[float, float, Option]]:
    """Lower convex hull of (cost, error) points, cheapest first, error strictly decreasing."""
    pareto: list[tuple[float, float, Option]] = []
    for point in sorted(points, key=lambda p: (p[0], p[1])):
        if not pareto or point[1] < pareto[-1][1]:  # same cost: the first is the best, the rest drop
            pareto.append(point)
    hull: list[tuple[float, float, Option]] = []
    for p in pareto:
        while len(hull) >= 2:
            (c1, e1, _), (c2, e2, _) = hull[-2], hull[-1]
            if (e1 - e2) * (p[0] - c2) <= (e2 - p[1]) * (c2 - c1):  # middle point not below the chord
                hull.pop()
            else:
                break
        hull.append(p)
    return hull


def allocate(layers: Mapping[str, LayerOptions], budget: float, unit: str = "bits") -> dict[str, Option]:
    """The option per layer minimising total error with total cost <= ``budget`` (bits or bytes over the
    linears). Greedy over hull segments by error saved per unit cost, then a fill with any option that
    still fits. Raises BudgetError when even the cheapest options do not fit."""
    points = {n: [(_cost(lo, o, unit), o.error, o) for o in lo.options] for n, lo in layers.items()}
    hulls = {n: _hull(p) for n, p in points.items()}
    position = dict.fromkeys(hulls, 0)
    total = sum(h[0][0] for h in hulls.values())
    if total > budget * (1 + 1e-9):
        raise BudgetError(
            f"impossible budget: the cheapest plan needs {total:.4g} {unit}, budget is {budget:.4g}"
        )
    segments = []
    for n, h in hulls.items():
        for i in range(len(h) - 1):
            slope = (h[i][1] - h[i + 1][1]) / max(h[i + 1][0] - h[i][0], 1e-30)
            segments.append((-slope, n, i))
    blocked: set[str] = set()
    for _, n, i in sorted(segments):
        if n in blocked or position[n] != i:
            continue
        step = hulls[n][i + 1][0] - hulls[n][i][0]
        if total + step <= budget:
            total += step
            position[n] = i + 1
        else:
            blocked.add(n)  # later segments of this layer must not be taken before this one
    chosen = {n: hulls[n][position[n]] for n in hulls}
    while True:  # fill: the single switch that saves the most error and still fits
        best = None
        for n, (cost, error, _) in chosen.items():
            for point in points[n]:
                if point[1] < error and total - cost + point[0] <= budget:
                    gain = error - point[1]
                    if best is None or gain > best[0]:
                        best = (gain, n, point)
        if best is None:
            break
        _, n, point = best
        total += point[0] - chosen[n][0]
        chosen[n] = point
    return {n: p[2] for n, p in chosen.items()}


# ---- analytic mode ----------------------------------------------------------------------------------
def analytic_bits(sigma: float, eps: float) -> int:
    """The analytic bit width ``b* = ceil(log2(1 + sigma / eps))``: enough levels to resolve ``eps`` at ``sigma``."""
    if sigma < 0 or eps <= 0:
        raise ValueError(f"need sigma >= 0 and eps > 0, got sigma={sigma}, eps={eps}")
    return max(1, math.ceil(math.log2(1 + sigma / eps)))


def analytic_eps(layers: Mapping[str, LayerOptions], kld: float) -> dict[str, float]:
    """Tolerable output noise per layer: each layer may add ``kld / L`` nats; with output noise of std eps
    on every channel a layer adds 0.5 * eps^2 * sum_n F_n (F: output Fisher), so eps = sqrt(2 kld / (L sum F))."""
    share = kld / max(len(layers), 1)
    return {n: math.sqrt(2 * share / max(lo.output_fisher, 1e-30)) for n, lo in layers.items()}


def analytic_choice(
    layers: Mapping[str, LayerOptions],
    eps: Mapping[str, float],
    formats: Sequence[str],
    group_size: int,
    symmetric: bool,
) -> dict[str, tuple[int, Option]]:
    """b* per layer from its output sigma, clamped to the nearest candidate format; the option measured
    for that format (int4: ``group_size`` or the largest group the layer allows)."""
    chosen = {}
    for name, lo in layers.items():
        bits = analytic_bits(lo.out_sigma, eps[name])
        usable = [f for f in formats if f != "int4" or int4_groups(lo.in_features, lo.out_features)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # clamping every layer is the point here, not news
            fmt = clamp_bits(bits, usable)
        plain = [o for o in lo.options if o.spec.format == fmt and not o.variant and o.spec.act_scale is None
                 and not o.spec.high_rows
                 and o.spec.clip_ratio == 1.0 and o.spec.scale_bits == SCALE_BITS
                 and (fmt != "int4" or o.spec.symmetric == symmetric)]  # fmt: skip
        groups = sorted({o.spec.group_size or 0 for o in plain})
        group = (
            group_size
            if group_size in groups
            else max((g for g in groups if g <= group_size), default=groups[0])
        )
        chosen[name] = (bits, next(o for o in plain if (o.spec.group_size or 0) == group))
    return chosen


# ---- plans -----------------------------------------------------------------------------------------
def plan_from_choices(choices: Mapping[str, Option]) -> tuple[QuantPlan, dict[str, Tensor]]:
    """One exact-name rule per layer, and the act scales the AWQ options need."""
    plan = QuantPlan({name: o.spec for name, o in choices.items()})
    tensors = {k: t for o in choices.values() for k, t in o.tensors.items()}
    return plan, tensors


def total_error(layers: Mapping[str, LayerOptions], choices: Mapping[str, Option]) -> float:
    return sum(choices[n].error for n in layers)


def avg_bits(layers: Mapping[str, LayerOptions], choices: Mapping[str, Option]) -> float:
    numel = sum(lo.numel for lo in layers.values())
    return sum(lo.numel * choices[n].bits for n, lo in layers.items()) / max(numel, 1)


# ---- result ----------------------------------------------------------------------------------------
@dataclass
class DQGResult:
    """A plan plus how it was chosen: per-layer measurements, the budget, perplexity checks."""

    mode: str  # "uniform" | "measured" | "analytic"
    plan: QuantPlan
    tensors: dict[str, Tensor] = field(default_factory=dict, repr=False)  # named by the plan's specs
    budget: str = ""
    layers: dict[str, LayerOptions] = field(default_factory=dict, repr=False)
    choices: dict[str, Option] = field(default_factory=dict)
    analytic: dict[str, int] = field(default_factory=dict)  # analytic mode: b* per layer before clamping
    ppl_checks: list[dict[str, float]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    calibration: dict[str, object] | None = None  # the CalibrationSettings the plan or its levels came from

    @property
    def avg_bits(self) -> float:
        return avg_bits(self.layers, self.choices) if self.choices else float("nan")

    @property
    def predicted_error(self) -> float:
        return total_error(self.layers, self.choices) if self.choices else float("nan")

    def precompensation_report(self) -> dict[str, dict[str, float]]:
        """Per technique: variants measured, share that reduced the layer's output error against the same
        format without it, median reduction, and the layers the plan applies it to with their reduction."""
        found: dict[str, list[tuple[str, float]]] = {}
        for name, lo in self.layers.items():
            for option in lo.options:
                for technique in filter(None, option.variant.split("+")):
                    base = _without(option, technique, lo.options)
                    if base is not None and base.rel_error > 0:
                        found.setdefault(technique, []).append((name, 1 - option.rel_error / base.rel_error))
        report = {}
        for technique, pairs in found.items():
            gains = sorted(g for _, g in pairs)
            applied = [
                1 - o.rel_error / b.rel_error
                for n, o in self.choices.items()
                if technique in o.variant.split("+") and (b := _without(o, technique, self.layers[n].options))
            ]
            report[technique] = {
                "measured": len(gains),
                "helped_share": sum(g > 0 for g in gains) / len(gains),
                "median_reduction": gains[len(gains) // 2],
                "applied_layers": len(applied),
                "applied_mean_reduction": sum(applied) / len(applied) if applied else 0.0,
            }
        return report

    def rows(self) -> list[dict[str, object]]:
        out = []
        for name, o in self.choices.items():
            lo = self.layers[name]
            base = _plain(o, lo.options)
            out.append({
                "layer": name, "role": lo.role, "sigma_w": lo.weight.sigma, "skew": lo.weight.skewness,
                "kurtosis": lo.weight.kurtosis, "outliers": lo.weight.outlier_ratio, "act_sigma": lo.act_sigma,
                "act_absmax": lo.act_absmax, "flagged": lo.flagged, "format": o.label, "bits": o.bits,
                "rel_error": o.rel_error, "error": o.error,
                "precomp_reduction": 1 - o.rel_error / base.rel_error if base and base.rel_error > 0 else None,
                **({"b_star": self.analytic[name]} if name in self.analytic else {}),
            })  # fmt: skip
        return out

    def to_dict(self) -> dict[str, object]:
        return {
            "mode": self.mode, "budget": self.budget, "avg_bits_per_weight": self.avg_bits,
            "predicted_error": self.predicted_error, "plan": self.plan.to_dict(), "plan_id": self.plan.plan_id,
            "precompensation": self.precompensation_report(), "ppl_checks": self.ppl_checks,
            "notes": self.notes, "calibration": self.calibration, "layers": self.rows(),
        }  # fmt: skip

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, default=float)

    def to_table(self):
        title = f"DQG {self.mode} plan {self.plan.plan_id}: {self.budget}"
        if self.choices:
            title += f" -> {self.avg_bits:.3f} bits/weight, est. error {self.predicted_error:.4g}"
        table = Table(title=title)
        rows = self.rows()
        if not rows:
            return self.plan.to_table()
        columns = [c for c in rows[0] if c != "flagged"]
        for column in columns:
            table.add_column(column, justify="left" if column in ("layer", "role", "format") else "right")
        for row in rows:
            cells = [_cell(row.get(c)) for c in columns]
            cells[0] += " *" if row["flagged"] else ""
            table.add_row(*cells)
        table.caption = "* flagged for pre-compensation (|skew| > 0.8 or kurtosis > 5)"
        return table


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return "" if value is None else str(value)


def _same(a: LayerQuantSpec, b: LayerQuantSpec) -> bool:
    return (a.format, a.group_size, a.symmetric, a.high_rows, a.scale_bits) == (
        b.format,
        b.group_size,
        b.symmetric,
        b.high_rows,
        b.scale_bits,
    )


def _without(option: Option, technique: str, options: Sequence[Option]) -> Option | None:
    """The measured option equal to ``option`` except without ``technique`` (row-score names, which carry the
    int4 variant's name, are not compared)."""
    spec, rest = option.spec, [t for t in option.variant.split("+") if t and t != technique]
    undo = {"zero_point": {"symmetric": True, "scale_bits": SCALE_BITS}, "mse_clip": {"clip_ratio": 1.0}, "awq": {"act_scale": None},
            "bias_corr": {"bias_correction": None}}  # fmt: skip
    want = _unnamed(dataclasses.replace(spec, **undo.get(technique, {})))
    return next((o for o in options if _unnamed(o.spec) == want and o.variant == "+".join(rest)), None)


def _unnamed(spec: LayerQuantSpec) -> LayerQuantSpec:
    return dataclasses.replace(spec, row_scores=None) if spec.row_scores is not None else spec


def _plain(option: Option, options: Sequence[Option]) -> Option | None:
    """The same format without any pre-compensation, when the option has some."""
    if not option.variant:
        return None
    return next((o for o in options if not o.variant and _same(o.spec, option.spec)), None) or next(
        (o for o in options if not o.variant and o.spec.format == option.spec.format
         and o.spec.group_size == option.spec.group_size and o.spec.high_rows == option.spec.high_rows),
        None)  # fmt: skip
