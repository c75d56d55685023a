"""How a calibrated int4 method's per-layer output errors compare with round-to-nearest's, in one line: the ratio
over the layers where rounding loses something, and how many layers rounding already reproduces exactly (weights
on the layout's own grid, such as a GGUF's Q4_1 re-quantized to asymmetric int4 g32, where no method can do
better and a ratio would be 0 / 0)."""

from __future__ import annotations

from collections.abc import Iterable


def ratio_line(pairs: Iterable[tuple[float, float]]) -> str:
    """``pairs`` of (method's error, round-to-nearest's) -> "median 0.41x (from 0.03x to 0.68x)", with
    "; N exact under round-to-nearest" where rounding's error is 0."""
    pairs = list(pairs)
    ratios = sorted(method / rtn for method, rtn in pairs if rtn > 0)
    exact = len(pairs) - len(ratios)
    parts = []
    if ratios:
        parts.append(f"median {ratios[len(ratios) // 2]:.3f}x (from {ratios[0]:.3f}x to {ratios[-1]:.3f}x)")
    if exact:
        parts.append(f"{exact} exact under round-to-nearest (already on the grid)")
    return "; ".join(parts)
