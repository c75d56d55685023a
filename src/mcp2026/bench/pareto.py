"""Pareto fronts: which points no other point beats on every objective (e.g. throughput up, latency down)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any


def _usable(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


def pareto_front(
    points: Sequence[Mapping[str, Any]],
    minimize: Sequence[str] = (),
    maximize: Sequence[str] = (),
) -> list[int]:
    """Indices (in input order) of the points no other point dominates. ``a`` dominates ``b`` when it is at
    least as good on every objective and strictly better on one; equal points are all on the front. Points
    missing an objective (None, NaN, absent) take no part: they are neither on the front nor dominate."""
    keys = [(k, 1.0) for k in minimize] + [(k, -1.0) for k in maximize]
    if not keys:
        raise ValueError("pareto_front needs at least one key to minimize or maximize")
    overlap = set(minimize) & set(maximize)
    if overlap:
        raise ValueError(f"pareto_front: {sorted(overlap)} cannot be both minimized and maximized")
    # Every objective as "smaller is better".
    costs = {
        i: tuple(sign * float(p[k]) for k, sign in keys)
        for i, p in enumerate(points)
        if all(_usable(p.get(k)) for k, _ in keys)
    }

    def dominates(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
        return all(x <= y for x, y in zip(a, b)) and any(x < y for x, y in zip(a, b))

    return [i for i, c in costs.items() if not any(dominates(o, c) for j, o in costs.items() if j != i)]
