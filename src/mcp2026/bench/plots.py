"""PNG plots of benchmark data. Each function takes plain data, writes one PNG and returns its path; with
nothing to draw it raises ``NoPlotData`` saying what was missing.

matplotlib drives the Agg canvas directly (no pyplot, no global backend
switch), so plotting works headless and from any thread.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

LATENCY_METRICS = {"ttft": "TTFT", "tpot": "TPOT", "e2e": "E2E latency"}
_LAYER_NAME = re.compile(r"^layers\.(\d+)\.(.+)$")


class NoPlotData(ValueError):
    """There is nothing to draw for this plot (the message says what data it needs)."""


@dataclass(frozen=True)
class ParetoPoint:
    x: float
    y: float
    label: str
    on_front: bool


def _figure(width: float = 7.0, height: float = 4.5, ncols: int = 1) -> tuple[Any, Any]:
    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig, fig.subplots(1, ncols, squeeze=False)[0]


def _save(fig: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


def _finite(values: Sequence[float]) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(v)]


def latency_cdfs(samples: Mapping[str, Mapping[str, Sequence[float]]], path: str | Path) -> Path:
    """Empirical CDFs of per-request latencies: one panel per metric (``ttft``, ``tpot``, ``e2e``, in ms),
    one line per series (label -> metric -> values)."""
    metrics = [m for m in LATENCY_METRICS if any(_finite(s.get(m, ())) for s in samples.values())]
    if not metrics:
        raise NoPlotData("latency CDFs need per-request TTFT/TPOT/E2E records (serve or offline runs)")
    fig, axes = _figure(4.2 * len(metrics), 3.8, len(metrics))
    for ax, metric in zip(axes, metrics):
        for label, series in samples.items():
            values = sorted(_finite(series.get(metric, ())))
            if values:
                fractions = [i / len(values) for i in range(len(values) + 1)]  # from 0 at the first value
                ax.step([values[0], *values], fractions, where="post", label=f"{label} (n={len(values)})")
        ax.set_xlabel(f"{LATENCY_METRICS[metric]} (ms)")
        ax.set_ylabel("fraction of requests <= x")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    return _save(fig, path)


def throughput_vs_rate(
    series: Mapping[str, Sequence[tuple[float, float]]],
    path: str | Path,
    ylabel: str = "output tokens/s",
) -> Path:
    """Measured throughput against the offered request rate, one line per series (label -> (rate, y))."""
    lines = {label: sorted((r, y) for r, y in points if math.isfinite(r)) for label, points in series.items()}
    lines = {label: points for label, points in lines.items() if points}
    if not lines:
        raise NoPlotData("throughput vs rate needs serve or sweep runs at a finite request rate")
    fig, (ax,) = _figure()
    for label, points in lines.items():
        ax.plot(*zip(*points), "o-", label=label)
    ax.set_xlabel("offered request rate (requests/s)")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, path)


def pareto_plot(
    points: Sequence[ParetoPoint], path: str | Path, xlabel: str, ylabel: str, title: str = ""
) -> Path:
    """Every point, the Pareto-optimal ones highlighted and joined in x order, each labelled."""
    points = [p for p in points if math.isfinite(p.x) and math.isfinite(p.y)]
    if not points:
        raise NoPlotData(f"a {ylabel} vs {xlabel} front needs rows with both values (sweep runs)")
    fig, (ax,) = _figure()
    rest = [p for p in points if not p.on_front]
    front = sorted((p for p in points if p.on_front), key=lambda p: p.x)
    if rest:
        ax.plot([p.x for p in rest], [p.y for p in rest], "o", color="0.6", label="dominated")
    if front:
        ax.plot([p.x for p in front], [p.y for p in front], "o-", color="C3", label="Pareto front")
    for p in points:
        ax.annotate(p.label, (p.x, p.y), fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, path)


def bit_plan_heatmap(layer_bits: Mapping[str, float], path: str | Path, title: str = "") -> Path:
    """Stored bits per weight of each decoder layer's linears: layers across, roles (``attn.qkv_proj``, ...)
    down. Linears outside the decoder layers (lm_head) are listed in the title."""
    grid: dict[str, dict[int, float]] = {}
    others = []
    for name, bits in layer_bits.items():
        match = _LAYER_NAME.match(name)
        if match:
            grid.setdefault(match.group(2), {})[int(match.group(1))] = float(bits)
        else:
            others.append(f"{name}: {float(bits):.3g}")
    if not grid:
        raise NoPlotData("a bit-plan heatmap needs per-layer bits (names like layers.0.attn.qkv_proj)")
    roles = list(grid)
    num_layers = 1 + max(i for row in grid.values() for i in row)
    values = [[grid[role].get(i, math.nan) for i in range(num_layers)] for role in roles]
    fig, (ax,) = _figure(max(5.0, 0.28 * num_layers + 2.5), 0.45 * len(roles) + 1.8)
    known = [v for row in values for v in row if not math.isnan(v)]
    # One scale for every plan (4 to 16 bits at least), so two heatmaps compare by colour.
    vmin, vmax = min(4.0, *known), max(16.0, *known)
    image = ax.imshow(values, aspect="auto", cmap="viridis", interpolation="nearest", vmin=vmin, vmax=vmax)
    if num_layers <= 32:
        for r, row in enumerate(values):
            for c, v in enumerate(row):
                if not math.isnan(v):
                    ax.text(
                        c, r, f"{v:.3g}", ha="center", va="center", fontsize=5, color="w" if v < 10 else "k"
                    )
    ax.set_yticks(range(len(roles)), roles, fontsize=7)
    step = max(1, num_layers // 16)
    ax.set_xticks(range(0, num_layers, step), [str(i) for i in range(0, num_layers, step)], fontsize=7)
    ax.set_xlabel("decoder layer")
    fig.colorbar(image, ax=ax, label="bits per weight")
    ax.set_title("; ".join(filter(None, [title, ", ".join(others)])), fontsize=8)
    return _save(fig, path)


def kv_usage_over_time(
    series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    path: str | Path,
    capacity: Mapping[str, int] | None = None,
    as_share: bool = False,
) -> Path:
    """KV blocks held against time (label -> (seconds, blocks)); ``capacity`` (label -> pool size) goes in
    the legend, not on the axis, so a large pool does not flatten the usage. ``as_share``: the values are
    shares of each server's pool (serving runs read them from the servers' /metrics)."""
    lines = {label: (t, b) for label, (t, b) in series.items() if len(t) and len(t) == len(b)}
    if not lines:
        raise NoPlotData(
            "KV usage over time needs a run that sampled KV usage (serve runs against a server with /metrics)"
            if as_share
            else "KV usage over time needs a run that sampled KV blocks (offline or sweep runs)"
        )
    fig, (ax,) = _figure()
    for label, (times, blocks) in lines.items():
        pool = (capacity or {}).get(label)
        ax.step(times, blocks, where="post", label=f"{label} (pool {pool})" if pool else label)
    ax.set_xlabel("seconds of load on the endpoint" if as_share else "seconds since the run started")
    ax.set_ylabel("share of the KV pool in use" if as_share else "KV blocks held by requests")
    ax.set_ylim(bottom=0, top=1.0 if as_share else None)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, path)
