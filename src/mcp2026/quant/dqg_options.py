"""What the DQG can store each linear layer as, and what each way costs: the candidate specs of a layer (formats,
int4 group sizes, pre-compensated variants, split rows for a vocabulary projection) and, measured on calibration
rows, each one's output error (``LayerOptions``), weighted per output channel by the diagonal empirical Fisher.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import Tensor, nn

from mcp2026.quant.calibrate import Calibration
from mcp2026.quant.plan import (
    CODED_SCALE_BITS,
    DENSE_FORMATS,
    INT4_GROUP_SIZES,
    SCALE_BITS,
    LayerQuantSpec,
    high_row_count,
)
from mcp2026.quant.quantizer import correction_bias, fake_quantize, search_act_scale, split_rows
from mcp2026.quant.stats import WeightStats, weight_stats

PRECOMPENSATIONS = ("flagged", "all", "none")
# Shares of a vocabulary projection's rows the DQG may keep in int8 (the rest int4): where the softmax puts
# its mass, a few percent of the rows carry nearly all of it (SmolLM2: 5% of rows ~87%, 15% ~95%).
# The grid is finer around 10-15%, where a 5-bit budget with fp16 grids lands on SmolLM2; with 8-bit grids in the
# body, a 5-bit budget leaves the lm_head room for a third of its rows or more.
HIGH_ROW_SHARES = (0.02, 0.05, 0.08, 0.1, 0.12, 0.14, 0.16, 0.2, 0.25, 0.3, 0.35, 0.4, 0.5)
WEIGHTINGS = ("fisher", "relative")


@dataclass(frozen=True)
class DQGSettings:
    weighting: str = "fisher"  # "fisher": Fisher-weighted output error (est. KLD); "relative": |dY|^2/|Y|^2
    precompensation: str = "flagged"  # try zero point / MSE clip / AWQ on: flagged layers, all, none
    symmetric_only: bool = False  # int4 with zero points only as pre-compensation (QuantConfig.symmetric)
    awq_alphas: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    analytic_kld: float = 0.01  # analytic mode: total tolerable KL divergence (nats/token), split evenly
    ppl_check_samples: int = 4  # max_ppl_increase: calibration samples the perplexity check runs on
    ppl_iterations: int = 6  # max_ppl_increase: bisection steps over the bits budget

    def __post_init__(self) -> None:
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"dqg.weighting must be one of {WEIGHTINGS}, got {self.weighting!r}")
        if self.precompensation not in PRECOMPENSATIONS:
            raise ValueError(
                f"dqg.precompensation must be one of {PRECOMPENSATIONS}, got {self.precompensation!r}"
            )


@dataclass(frozen=True)
class Option:
    """One way to store one layer, with its measured error."""

    spec: LayerQuantSpec
    variant: str  # "" (plain) or "+"-joined pre-compensations: zero_point, mse_clip, awq
    bits: float  # stored bits per weight, scales and zeros included
    error: float  # what the allocation minimises (est. KLD with Fisher weighting)
    rel_error: float  # ||x dW^T||^2 / ||x W^T||^2 on the calibration rows
    tensors: dict[str, Tensor] = field(default_factory=dict, compare=False, repr=False)  # named in spec

    @property
    def label(self) -> str:
        s = self.spec
        text = s.format if s.format != "int4" else f"int4 g{s.group_size} {'sym' if s.symmetric else 'asym'}"
        text += " s8" if s.scale_bits != SCALE_BITS else ""
        text += f" ({s.high_rows:.0%} rows int8)" if s.high_rows else ""
        return f"{text} +{self.variant}" if self.variant else text


@dataclass
class LayerOptions:
    name: str
    role: str
    out_features: int
    in_features: int
    is_tied: bool  # shares its weight with another module (a tied lm_head)
    weight: WeightStats
    act_sigma: float  # mean over input channels of the activation std
    act_absmax: float
    out_sigma: float  # std of x W^T on the calibration rows
    output_fisher: float  # sum over output channels of E[(dL/dy)^2] (0 without Fisher)
    options: list[Option]

    @property
    def numel(self) -> int:
        return self.out_features * self.in_features

    @property
    def flagged(self) -> bool:
        return self.weight.needs_precompensation


def role_of(name: str) -> str:
    for key, role in (("qkv", "attn_qkv"), ("o_proj", "attn_out"), ("gate_up", "ffn_gate_up"),
                      ("down", "ffn_down"), ("lm_head", "lm_head")):  # fmt: skip
        if key in name:
            return role
    return "linear"


def tied_linears(model: nn.Module) -> set[str]:
    """Names of linears whose weight storage is shared with another parameter (a tied lm_head)."""
    owners: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owners.setdefault(param.untyped_storage().data_ptr(), []).append(name)
    shared = {n.removesuffix(".weight") for names in owners.values() if len(names) > 1 for n in names}
    return {n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n in shared}


def int4_groups(in_features: int, out_features: int) -> list[int]:
    """Group sizes the int4 kernel accepts for this shape (group | K, N a multiple of 16)."""
    return [g for g in INT4_GROUP_SIZES if in_features % g == 0] if out_features % 16 == 0 else []


def candidate_specs(
    linear: nn.Linear, formats: Sequence[str], settings: DQGSettings, precompensate: bool
) -> list[tuple[LayerQuantSpec, str]]:
    """(spec, variant) pairs to measure; the AWQ variant's act_scale name is filled in by the caller."""
    out: list[tuple[LayerQuantSpec, str]] = []
    n, k = linear.out_features, linear.in_features
    for fmt in formats:
        if fmt in DENSE_FORMATS:
            out.append((LayerQuantSpec(fmt), ""))
        elif fmt in ("int8", "fp8"):
            out.append((LayerQuantSpec(fmt), ""))
            if precompensate:
                out.append((LayerQuantSpec(fmt, clip_ratio="mse"), "mse_clip"))
        elif fmt == "int4":
            for g in int4_groups(k, n):
                for symmetric, scale_bits in _int4_grids(settings):
                    zero_point = "zero_point" if settings.symmetric_only and not symmetric else ""
                    if zero_point and not precompensate:
                        continue
                    base = LayerQuantSpec("int4", g, symmetric, scale_bits=scale_bits)
                    out.append((base, zero_point))
                    if precompensate:
                        joined = "+".join(filter(None, (zero_point, "mse_clip")))
                        out.append((dataclasses.replace(base, clip_ratio="mse"), joined))
                        out.append((dataclasses.replace(base, act_scale="awq"), "+".join(filter(None, (zero_point, "awq")))))  # fmt: skip
    return out


def _int4_grids(settings: DQGSettings) -> list[tuple[bool, int]]:
    """(symmetric, scale_bits) of the int4 candidates: symmetric, with zero points, and with zero points on 8-bit
    grids (not in symmetric-only mode, where zero points are a pre-compensation)."""
    grids = [(True, SCALE_BITS), (False, SCALE_BITS)]
    return grids if settings.symmetric_only else [*grids, (False, CODED_SCALE_BITS)]


def split_specs(
    linear: nn.Linear, formats: Sequence[str], settings: DQGSettings
) -> list[tuple[LayerQuantSpec, str]]:
    """A vocabulary projection's extra candidates: int4 (each group size) with ``HIGH_ROW_SHARES`` of its rows
    in int8, each also with bias correction. The caller names the row scores and the mean input."""
    if "int4" not in formats or "int8" not in formats:
        return []
    out = []
    for g in int4_groups(linear.in_features, linear.out_features):
        grids = [(True, SCALE_BITS)] if settings.symmetric_only else _int4_grids(settings)
        for symmetric, scale_bits in grids:
            counts = {high_row_count(linear.out_features, s): s for s in reversed(HIGH_ROW_SHARES)}
            for share in sorted(s for k, s in counts.items() if k):  # distinct, non-empty splits only
                spec = LayerQuantSpec("int4", g, symmetric, high_rows=share, scale_bits=scale_bits)
                out += [(spec, ""), (dataclasses.replace(spec, bias_correction="mean"), "bias_corr")]
    return out


def layer_options(
    name: str,
    linear: nn.Linear,
    calib: Calibration,
    formats: Sequence[str],
    settings: DQGSettings,
    is_tied: bool,
) -> LayerOptions:
    layer = calib.layers[name]
    w = linear.weight.detach().float()
    x = layer.rows.to(w.device)  # (R, K)
    y = x @ w.T  # (R, N)
    y_energy = y.pow(2).sum().clamp_min(1e-30)
    fisher = layer.output_fisher.to(w.device) if layer.output_fisher is not None else None
    use_fisher = settings.weighting == "fisher" and fisher is not None
    stats = weight_stats(w)
    precompensate = settings.precompensation == "all" or (
        settings.precompensation == "flagged" and stats.needs_precompensation
    )
    options = []
    specs = candidate_specs(linear, formats, settings, precompensate)
    if role_of(name) == "lm_head":
        specs += split_specs(linear, formats, settings)
    mean = layer.activations.mean.to(w.device)
    splits: dict[object, _SplitParts] = {}  # by (group, symmetric), and "int8"
    for spec, variant in specs:
        tensors: dict[str, Tensor] = {}
        scale = None
        if spec.act_scale is not None:
            base = LayerQuantSpec(spec.format, spec.group_size, spec.symmetric)
            scale, alpha, _ = search_act_scale(w, x, base, settings.awq_alphas)
            if alpha == 0.0:
                continue  # no scaling helps here: the plain variant already covers this point
            spec = dataclasses.replace(spec, act_scale=name)
            tensors[name] = scale
        if spec.bias_correction is not None:
            spec = dataclasses.replace(spec, bias_correction=f"{name}:input_mean")
            tensors[spec.bias_correction] = mean
        if spec.high_rows:
            key = (spec.group_size, spec.symmetric, spec.scale_bits)
            if key not in splits:
                if "int8" not in splits:
                    splits["int8"] = _SplitParts.of(w, x, mean, LayerQuantSpec("int8"))
                splits[key] = _SplitParts.of(w, x, mean, spec, splits["int8"], fisher if use_fisher else None)
            grid = f"int4-g{key[0]}-{'sym' if key[1] else 'asym'}" + (
                "" if key[2] == SCALE_BITS else f"-s{key[2]}"
            )
            spec = dataclasses.replace(spec, row_scores=f"{name}:row_scores:{grid}")
            tensors[spec.row_scores] = splits[key].scores
            dy = splits[key].with_high_rows(splits["int8"], split_rows(w, spec, splits[key].scores), spec)
        else:
            wq = fake_quantize(w, spec, scale)
            dy = x @ (wq - w).T  # (R, N)
            if spec.bias_correction is not None:
                dy = dy + correction_bias(w, wq, mean)
        rel = (dy.pow(2).sum() / y_energy).item()
        error = 0.5 * (dy.pow(2).mean(0) * fisher).sum().item() if use_fisher else rel
        bits = spec.bits_per_weight(linear.in_features, linear.out_features)
        options.append(Option(spec, variant, bits, error, rel, tensors))
    act = layer.activations
    return LayerOptions(
        name, role_of(name), linear.out_features, linear.in_features, is_tied, stats,
        act.sigma.mean().item(), act.absmax.max().item(), y.std().item(),
        fisher.sum().item() if fisher is not None else 0.0, options,
    )  # fmt: skip


@dataclass
class _SplitParts:
    """One format's output error on the calibration rows, per output row: a split layer's error is the int4
    column of every row but the chosen ones, which take the int8 column (rows are quantized independently), so
    every share of int8 rows is measured without quantizing the weight again."""

    dy: Tensor  # (R, N) x (Wq - W)^T
    bias: Tensor  # (N,) the correction bias -E[x] (Wq - W)^T
    scores: Tensor | None  # (N,) int4 parts: error saved per row by int8, Fisher-weighted (the row ranking)

    @classmethod
    def of(cls, w: Tensor, x: Tensor, mean: Tensor, spec: LayerQuantSpec, high: _SplitParts | None = None,
           fisher: Tensor | None = None) -> _SplitParts:  # fmt: skip
        base = dataclasses.replace(spec, high_rows=0.0, row_scores=None, bias_correction=None)
        wq = fake_quantize(w, base)
        dy = x @ (wq - w).T
        scores = None
        if high is not None:
            saved = dy.pow(2).mean(0) - high.dy.pow(2).mean(0)
            scores = saved if fisher is None else saved * fisher
        return cls(dy, correction_bias(w, wq, mean), scores)

    def with_high_rows(self, high: _SplitParts, rows: Tensor, spec: LayerQuantSpec) -> Tensor:
        dy = self.dy.clone()
        dy[:, rows] = high.dy[:, rows]
        if spec.bias_correction is not None:
            bias = self.bias.clone()
            bias[rows] = high.bias[rows]
            dy += bias
        return dy
