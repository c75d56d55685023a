"""The quantization math: quantize / dequantize int8, int4 and fp8 weights, fake-quantize a weight as a plan's
spec would store it, and the searches that lower the error (clipping and least-squares grids per group,
activation-aware scaling, rows kept in int8, bias correction). Plain functions, so the DQG measures errors
without building modules; ``linear`` stores what they return.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import Tensor

from mcp2026.quant.plan import DENSE_FORMATS, SCALE_BITS, LayerQuantSpec, high_row_count

DENSE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# NOTE: scales and zero points are rounded to fp16 once, when quantizing: artifacts store them in 16 bits
# losslessly, every kernel widens the same numbers to fp32, and fp16 is what GGUF's Q4_0 / Q4_1 / Q8_0 store,
# so a weight already on such a grid gets its own grid back (bf16's 8-bit mantissa would move each group by its
# zero's rounding).
SCALE_DTYPE = torch.float16
SCALE_MAX = float(torch.finfo(SCALE_DTYPE).max)
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
CLIP_GRID = tuple(round(1.0 - 0.05 * i, 2) for i in range(11))  # 1.0 .. 0.5
ALPHA_GRID = tuple(i / 10 for i in range(11))  # 0.0 (no scaling) .. 1.0
_TINY = 2.0**-24  # fp16's smallest positive value: a scale rounds to it, never to 0


def _round_scale(t: Tensor) -> Tensor:
    rounded = t.to(SCALE_DTYPE)
    if not torch.isfinite(rounded).all():
        peak = float(t.abs().nan_to_num(posinf=float("inf")).max())
        raise ValueError(
            f"a quantization scale or zero point of {peak:.3g} is outside fp16's range (±{SCALE_MAX:.0f}): "
            "the weights hold values too large (or not finite) to quantize; keep this layer in a float format"
        )
    return rounded.float()


# ---- int8, per output channel, symmetric ---------------------------------------------------------
def quantize_per_channel_int8(w: Tensor, clip_ratio: float | Tensor = 1.0) -> tuple[Tensor, Tensor]:
    """w (N, K) -> q int8 (N, K) in [-127, 127], scales (N,) fp32; w ~= q * scales[:, None].
    ``clip_ratio``: a float or one ratio per output channel (N,)."""
    w = w.float()
    scales = _round_scale((w.abs().amax(dim=1) * torch.as_tensor(clip_ratio) / 127).clamp_min(_TINY))
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


def dequantize_per_channel_int8(q: Tensor, scales: Tensor) -> Tensor:
    return q.float() * scales[:, None].float()


# ---- int8, group-wise, symmetric (GGUF's Q8_0 with an fp16 scale when g = 32) ------------------------
def quantize_groupwise_int8(
    w: Tensor, group_size: int, clip_ratio: float | Tensor = 1.0
) -> tuple[Tensor, Tensor]:
    """w (N, K) -> q int8 (N, K) in [-127, 127], scales (N, K/g); w ~= q * scale of its group.
    ``clip_ratio``: a float or one ratio per group (N, K/g)."""
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"int8 group size {group_size} must divide in_features={k}")
    wg = w.float().reshape(n, k // group_size, group_size)  # (N, G, g)
    clip = torch.as_tensor(clip_ratio, dtype=torch.float32)
    scales = _round_scale((wg.abs().amax(-1) * clip / 127).clamp_min(_TINY))  # (N, G)
    q = torch.round(wg / scales.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
    return q.reshape(n, k), scales


def dequantize_groupwise_int8(q: Tensor, scales: Tensor) -> Tensor:
    n, k = q.shape
    groups = scales.shape[1]
    return (q.float().reshape(n, groups, k // groups) * scales.float().unsqueeze(-1)).reshape(n, k)


# ---- int4, group-wise, kernel convention w = (q - 8) * scale + zero ----------------------------
def quantize_groupwise_int4(
    w: Tensor, group_size: int, symmetric: bool = False, clip_ratio: float | Tensor = 1.0
) -> tuple[Tensor, Tensor, Tensor]:
    """w (N, K) -> q uint8 (N, K) in [0, 15], scales (N, K/g), zeros (N, K/g), with
    w ~= (q - 8) * scale + zero (the convention of ``_weight_int4pack_mm_for_cpu``).

    Asymmetric (llama.cpp's Q4_1): the group's [min, max] (times ``clip_ratio``) maps onto the 16 levels, so
    weights already on such a grid get their own levels back. Symmetric (Q4_0): zero = 0 and the group's
    value of largest magnitude lands exactly on level -8, so all 16 levels are used (the scale is negative
    when that value is positive). ``clip_ratio`` may be (N, K/g).
    """
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"int4 group size {group_size} must divide in_features={k}")
    wg = w.float().reshape(n, k // group_size, group_size)  # (N, G, g)
    clip = torch.as_tensor(clip_ratio, dtype=torch.float32)
    clip = clip.unsqueeze(-1) if clip.dim() else clip
    if symmetric:
        peak = wg.gather(-1, wg.abs().argmax(-1, keepdim=True)) * clip  # (N, G, 1), signed
        scales = _nonzero(_round_scale(-peak / 8))
        zeros = torch.zeros_like(scales)
    else:
        hi, lo = wg.amax(-1, keepdim=True) * clip, wg.amin(-1, keepdim=True) * clip
        scales = _round_scale(((hi - lo) / 15).clamp_min(_TINY))
        zeros = _round_scale(lo + 8 * scales)
    q = nearest_levels(wg, scales, zeros)
    return q.reshape(n, k), scales.squeeze(-1), zeros.squeeze(-1)


def _nonzero(scales: Tensor) -> Tensor:
    return torch.where(scales.abs() < _TINY, torch.full_like(scales, _TINY), scales)


def nearest_levels(wg: Tensor, scales: Tensor, zeros: Tensor) -> Tensor:
    """Nearest level 0..15 of each weight (N, G, g) on the grids (N, G, 1) ``(q - 8) * scales + zeros``."""
    return (torch.round((wg - zeros) / scales) + 8).clamp(0, 15).to(torch.uint8)


def _least_squares_grid(wg: Tensor, q: Tensor, symmetric: bool) -> tuple[Tensor, Tensor]:
    """The scale and zero (N, G, 1) that fit ``(q - 8) * scale + zero`` to ``wg`` best for the given levels
    (zero = 0 when symmetric); a group whose levels are all equal keeps a fit of its mean."""
    p = q.float() - 8  # (N, G, g)
    sum_p, sum_w, sum_pp, sum_pw = p.sum(-1), wg.sum(-1), (p * p).sum(-1), (p * wg).sum(-1)
    if symmetric:
        scale, zero = sum_pw / sum_pp.clamp_min(_TINY), torch.zeros_like(sum_w)
    else:
        g = wg.shape[-1]
        det = g * sum_pp - sum_p * sum_p  # 0 only when every level in the group is the same
        scale = torch.where(
            det > 0, (g * sum_pw - sum_p * sum_w) / det.clamp_min(_TINY), torch.ones_like(det)
        )
        zero = (sum_w - scale * sum_p) / g
    return _nonzero(_round_scale(scale)).unsqueeze(-1), _round_scale(zero).unsqueeze(-1)


def search_groupwise_int4(
    w: Tensor, group_size: int, symmetric: bool = False, ratios: Sequence[float] = CLIP_GRID
) -> tuple[Tensor, Tensor, Tensor]:
    """``quantize_groupwise_int4`` with each group's grid chosen for the least squared weight error: for each
    clip ratio, the min/max (or peak) grid and its least-squares refit to the levels it assigns (as llama.cpp's
    k-quants refine theirs). The unclipped grid is a candidate and a refit only replaces it when strictly
    better, so a weight already on a grid keeps it."""
    n, k = w.shape
    wg = w.float().reshape(n, k // group_size, group_size)  # (N, G, g)
    best: tuple[Tensor, Tensor, Tensor, Tensor] | None = None  # q, scales, zeros, error
    for ratio in ratios:
        q, scales, zeros = quantize_groupwise_int4(w, group_size, symmetric, ratio)
        q = q.reshape(wg.shape)
        grids = [(scales.unsqueeze(-1), zeros.unsqueeze(-1)), _least_squares_grid(wg, q, symmetric)]
        for s, z in grids:
            levels = nearest_levels(wg, s, z)
            err = ((levels.float() - 8) * s + z - wg).pow(2).sum(-1, keepdim=True)  # (N, G, 1)
            if best is None:
                best = (levels, s, z, err)
                continue
            better = err < best[3]
            best = tuple(torch.where(better, new, old) for new, old in zip((levels, s, z, err), best))  # type: ignore[assignment]
    assert best is not None, "ratios must not be empty"
    return best[0].reshape(n, k), best[1].squeeze(-1), best[2].squeeze(-1)


# ---- int4 grids in 8 bits (LayerQuantSpec.scale_bits 8) ------------------------------------------------
# Each row's group scales are codes 1..255 times the row's power-of-two scale step, its zeros codes -127..127 times
# its zero step. The steps are chosen so that the row's largest scale (zero) lands on the top half of the codes,
# and a code times a power of two of at least 2**-24 is exactly an fp16 value: the decoded grid is an ordinary
# fp16 grid, which every kernel runs as it runs any other.
_SCALE_CODE_MAX, _ZERO_CODE_MAX = 255, 127
_MIN_EXPONENT = -24  # fp16's smallest subnormal


def _step_exponent(peak: Tensor, code_max: int) -> Tensor:
    """(N,) int: the smallest exponent e whose steps 2**e code ``peak`` (N,) at most at ``code_max``: the peak
    lands in the top half of the codes."""
    _, e = torch.frexp(peak.clamp_min(2.0**_MIN_EXPONENT))  # peak = m 2**e, m in [0.5, 1)
    e = e - code_max.bit_length()
    e = e + (torch.round(torch.ldexp(peak, -e)) > code_max).to(e.dtype)  # a peak just under a power of two
    return e.clamp_min(_MIN_EXPONENT)


def grid_exponents(scales: Tensor, zeros: Tensor) -> Tensor:
    """(N, 2) int8: each row's scale and zero step exponents for its (N, G) ``scales`` and ``zeros``."""
    return torch.stack(
        [
            _step_exponent(scales.abs().amax(-1), _SCALE_CODE_MAX),
            _step_exponent(zeros.abs().amax(-1), _ZERO_CODE_MAX),
        ],
        dim=-1,
    ).to(torch.int8)


def _steps(exponents: Tensor, device: torch.device) -> tuple[Tensor, Tensor]:
    """The rows' (N, 1) scale and zero steps 2**e on ``device``."""
    e = exponents.to(device=device, dtype=torch.int32)
    one = torch.ones(e.shape[0], 1, device=device)
    return torch.ldexp(one, e[:, :1]), torch.ldexp(one, e[:, 1:])


def code_grids(scales: Tensor, zeros: Tensor, exponents: Tensor) -> tuple[Tensor, Tensor]:
    """(N, G) scales and zeros moved to the nearest codes on the rows' steps (``exponents`` (N, 2)): what an
    8-bit-scale layer stores. Scales keep code 1 at least, so no group's scale becomes 0."""
    scale_step, zero_step = _steps(exponents, scales.device)
    coded_scales = torch.round(scales.float() / scale_step).clamp(1, _SCALE_CODE_MAX) * scale_step
    coded_zeros = torch.round(zeros.float() / zero_step).clamp(-_ZERO_CODE_MAX, _ZERO_CODE_MAX) * zero_step
    return _round_scale(coded_scales), _round_scale(coded_zeros)


def grid_codes(scales: Tensor, zeros: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Coded (N, G) scales and zeros -> (scale codes uint8, zero codes int8, exponents int8 (N, 2)), exact: the
    rows' steps are read off the values (never coarser than the steps they were coded on). Raises ValueError when
    a value is not on its row's code grid (a grid that was not coded, e.g. fp16 grids of another method)."""
    exponents = grid_exponents(scales, zeros)
    scale_step, zero_step = _steps(exponents, scales.device)
    scale_codes, zero_codes = scales.float() / scale_step, zeros.float() / zero_step
    exact = (
        (scale_codes == scale_codes.round()).all()
        and (zero_codes == zero_codes.round()).all()
        and bool(((scale_codes >= 0) & (scale_codes <= _SCALE_CODE_MAX)).all())
        and bool((zero_codes.abs() <= _ZERO_CODE_MAX).all())
    )
    if not exact:
        raise ValueError(
            "int4 grids are not on 8-bit codes (scale_bits 8): quantize with this spec (quantize_int4) or store "
            "fp16 grids (scale_bits 16)"
        )
    return scale_codes.to(torch.uint8), zero_codes.to(torch.int8), exponents


def decode_grids(scale_codes: Tensor, zero_codes: Tensor, exponents: Tensor) -> tuple[Tensor, Tensor]:
    """Inverse of ``grid_codes``: (N, G) fp32 scales and zeros, each exactly an fp16 value."""
    scale_step, zero_step = _steps(exponents, scale_codes.device)
    return scale_codes.float() * scale_step, zero_codes.float() * zero_step


def dequantize_groupwise_int4(q: Tensor, scales: Tensor, zeros: Tensor, group_size: int) -> Tensor:
    n, k = q.shape
    qg = q.float().reshape(n, k // group_size, group_size) - 8  # (N, G, g)
    return (qg * scales.float().unsqueeze(-1) + zeros.float().unsqueeze(-1)).reshape(n, k)


# ---- fp8 e4m3, per output channel ---------------------------------------------------------------
def quantize_per_channel_fp8(w: Tensor, clip_ratio: float | Tensor = 1.0) -> tuple[Tensor, Tensor]:
    w = w.float()
    scales = _round_scale((w.abs().amax(dim=1) * torch.as_tensor(clip_ratio) / FP8_MAX).clamp_min(_TINY))
    return (w / scales[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scales


# ---- fake quantization, clipping and activation-aware scaling -------------------------------------
def quantize_int4(
    w: Tensor, spec: LayerQuantSpec, exponents: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """(q, scales, zeros) of ``w`` as an int4 ``spec`` stores it: clip_ratio "mse" searches each group's grid
    (``search_groupwise_int4``), a float clips every group by that ratio. With 8-bit scales the grids move to
    their codes (on the rows' steps: ``exponents`` (N, 2), or the rows' own) and the weights are rounded again
    to the coded grids."""
    if spec.clip_ratio == "mse":
        q, scales, zeros = search_groupwise_int4(w, spec.group_size, spec.symmetric)
    else:
        q, scales, zeros = quantize_groupwise_int4(w, spec.group_size, spec.symmetric, spec.clip_ratio)
    if spec.scale_bits == SCALE_BITS:
        return q, scales, zeros
    if exponents is None:
        exponents = grid_exponents(scales, zeros)
    scales, zeros = code_grids(scales, zeros, exponents)
    n, k = w.shape
    wg = w.float().reshape(n, k // spec.group_size, spec.group_size)
    q = nearest_levels(wg, scales.unsqueeze(-1), zeros.unsqueeze(-1)).reshape(n, k)
    return q, scales, zeros


def _qdq(w: Tensor, spec: LayerQuantSpec, clip: float | Tensor) -> Tensor:
    if spec.format == "int4":
        q, s, z = quantize_groupwise_int4(w, spec.group_size, spec.symmetric, clip)
        return dequantize_groupwise_int4(q, s, z, spec.group_size)
    if spec.format == "int8" and spec.group_size:
        return dequantize_groupwise_int8(*quantize_groupwise_int8(w, spec.group_size, clip))
    if spec.format == "int8":
        return dequantize_per_channel_int8(*quantize_per_channel_int8(w, clip))
    if spec.format == "fp8":
        q, s = quantize_per_channel_fp8(w, clip)
        return q.float() * s[:, None]
    return w.to(DENSE_DTYPES[spec.format]).float()


def mse_clip_ratios(
    w: Tensor, spec: LayerQuantSpec, ratios: Sequence[float] = CLIP_GRID, channel_weight: Tensor | None = None
) -> Tensor:
    """Per-group (int4, grouped int8: (N, K/g)) or per-channel (int8/fp8: (N,)) clip ratio minimizing the
    squared weight error, optionally weighted per input channel (e.g. by E[x^2] from calibration)."""
    n, k = w.shape
    group = spec.group_size or k
    weight = torch.ones(k) if channel_weight is None else channel_weight.float()
    best_err = torch.full((n, k // group), float("inf"))
    best = torch.ones(n, k // group)
    for ratio in ratios:
        clip = ratio if spec.group_size else torch.full((n,), ratio)
        err = ((_qdq(w, spec, clip) - w.float()) ** 2 * weight).reshape(n, k // group, group).sum(-1)
        better = err < best_err
        best = torch.where(better, torch.tensor(float(ratio)), best)
        best_err = torch.where(better, err, best_err)
    return best if spec.group_size else best.squeeze(1)


def fake_quantize(
    w: Tensor, spec: LayerQuantSpec, act_scale: Tensor | None = None, row_scores: Tensor | None = None
) -> Tensor:
    """The effective fp32 weight a module built from ``spec`` computes with (act scale folded back;
    a split spec's int8 rows chosen by ``row_scores`` as ``split_rows`` does)."""
    if spec.method != "rtn":
        raise ValueError(
            f"{spec.method} levels depend on the layer's calibration inputs: quantize with quant.gptq / "
            "quant.learned_scales"
        )
    if spec.format in DENSE_FORMATS:
        return _qdq(w, spec, 1.0)
    if spec.high_rows:
        deq = fake_quantize(w, _low_spec(spec))
        high = split_rows(w, spec, row_scores, deq)
        deq[high] = fake_quantize(w[high], _high_spec(spec))
        return deq
    scaled = w.float() if act_scale is None else w.float() * act_scale
    if spec.format == "int4":
        deq = dequantize_groupwise_int4(*quantize_int4(scaled, spec), spec.group_size)
    else:
        clip = mse_clip_ratios(scaled, spec) if spec.clip_ratio == "mse" else spec.clip_ratio
        deq = _qdq(scaled, spec, clip)
    return deq if act_scale is None else deq / act_scale


# ---- split rows and bias correction ----------------------------------------------------------------
def _low_spec(spec: LayerQuantSpec) -> LayerQuantSpec:
    return dataclasses.replace(spec, high_rows=0.0, row_scores=None, bias_correction=None)


def _high_spec(spec: LayerQuantSpec) -> LayerQuantSpec:
    return LayerQuantSpec("int8", clip_ratio=spec.clip_ratio)


def split_rows(
    w: Tensor, spec: LayerQuantSpec, row_scores: Tensor | None = None, low: Tensor | None = None
) -> Tensor:
    """Sorted indices of the rows a split spec stores in int8: the top ``high_row_count`` by ``row_scores``
    (N,), or, without scores, by each row's squared int4 weight error (``low``: the int4 fake-quantized
    weight, when the caller has it). Ties go to the lower row index (stable), so the choice is repeatable."""
    n = w.shape[0]
    k = high_row_count(n, spec.high_rows)
    if row_scores is None:
        low = fake_quantize(w, _low_spec(spec)) if low is None else low
        row_scores = (low - w.float()).pow(2).sum(1)
    elif row_scores.shape != (n,):
        raise ValueError(
            f"row_scores must have one score per output row ({n},), got {tuple(row_scores.shape)}"
        )
    order = torch.sort(-row_scores.float().cpu(), stable=True).indices[:k]
    return order.sort().values.to(w.device)


def correction_bias(w: Tensor, quantized: Tensor, input_mean: Tensor) -> Tensor:
    """(N,) bias cancelling the quantization error's mean effect: -E[x] @ (Wq - W).T (bias correction of
    data-free quantization, Nagel et al. 2019), with E[x] from calibration."""
    if input_mean.shape != (w.shape[1],):
        raise ValueError(
            f"input mean must have one value per input channel ({w.shape[1]},), got {tuple(input_mean.shape)}"
        )
    return -(input_mean.float().to(w.device) @ (quantized.float() - w.float()).T)


def search_act_scale(
    w: Tensor, x: Tensor, spec: LayerQuantSpec, alphas: Sequence[float] = ALPHA_GRID
) -> tuple[Tensor, float, float]:
    """Activation-aware scaling (AWQ): s = mean|x|^alpha per input channel, normalized to a geometric
    mean of 1; returns (s, alpha, relative output error) minimizing ||x W^T - x Wq(s)^T||^2 on the
    calibration rows ``x`` (T, K). alpha = 0 (no scaling) is in the grid, so it never does worse here."""
    x = x.float().reshape(-1, w.shape[1])
    reference = x @ w.float().T
    magnitude = x.abs().mean(0).clamp_min(1e-5)
    best: tuple[Tensor, float, float] = (torch.ones_like(magnitude), 0.0, float("inf"))
    for alpha in alphas:
        scale = magnitude**alpha
        scale = scale / (scale.max() * scale.min()).sqrt()
        err = ((x @ fake_quantize(w, spec, scale).T - reference) ** 2).sum().item()
        if err < best[2]:
            best = (scale, float(alpha), err)
    return best[0], best[1], best[2] / max((reference**2).sum().item(), 1e-30)
