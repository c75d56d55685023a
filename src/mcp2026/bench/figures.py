"""Which plots a set of benchmark runs supports, the data for each (read from the runs' records and
aggregates), and the report folder: PNGs plus a ``report.md`` that shows each run's tables and the plots.

A plot without data is skipped with a message (``Figures.skipped``), never drawn empty.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mcp2026.bench import plots
from mcp2026.bench.report import BenchRun, render_markdown

LabelledRun = tuple[str, BenchRun]  # (label, run): the label names the run in legends
# (title, file stem, row key on the y axis, row key marking the front, y label); x is the sweep's latency metric
FRONTS = (
    ("PPL vs latency front", "ppl-front", "ppl", "quality_front", "perplexity"),
    (
        "Throughput vs latency front",
        "throughput-front",
        "output_throughput",
        "throughput_front",
        "output tokens/s",
    ),
)


@dataclass
class Figures:
    paths: list[tuple[str, Path]] = field(default_factory=list)  # (title, PNG)
    skipped: list[str] = field(default_factory=list)  # "<plot>: <why>"


def _ms(seconds: Any) -> float | None:
    return 1e3 * seconds if isinstance(seconds, (int, float)) else None


def _tpot_ms(ttft_s: Any, e2e_s: Any, num_tokens: Any) -> float | None:
    if not all(isinstance(v, (int, float)) for v in (ttft_s, e2e_s, num_tokens)) or num_tokens < 2:
        return None
    return 1e3 * (e2e_s - ttft_s) / (num_tokens - 1)


def _serve_samples(records: Sequence[Mapping[str, Any]]) -> list[tuple[Any, Any, Any]]:
    return [
        (r.get("ttft"), r.get("latency"), r.get("output_tokens"))
        for r in records
        if r.get("success", True) and r.get("kind", "normal") == "normal"
    ]


def latency_samples(run: BenchRun, label: str = "") -> dict[str, dict[str, list[float]]]:
    """Per-request TTFT/TPOT/E2E (ms), series label -> metric -> values: a serve run's successful normal
    requests (a series per endpoint in a side-by-side run), our engine's requests in an offline run (the
    HF peer's static batches have no per-request TTFT), each (config, rate) row of a sweep."""
    label = label or run.kind
    series: dict[str, list[tuple[Any, Any, Any]]] = {}
    if run.kind == "serve":
        endpoints = list(dict.fromkeys(r.get("endpoint") or "" for r in run.records))
        if len(endpoints) > 1:  # side by side: a series per endpoint
            for name in endpoints:
                mine = [r for r in run.records if (r.get("endpoint") or "") == name]
                series[f"{label} {name}"] = _serve_samples(mine)
        else:
            series[label] = _serve_samples(run.records)
    elif run.kind.startswith("offline"):  # a series per configuration of ours (fp32, int8 weights, ...)
        engines = [
            e for e in dict.fromkeys(r.get("engine") for r in run.records) if str(e).startswith("mcp2026")
        ]
        for engine in engines:
            name = label if engine == "mcp2026" else f"{label} {engine.removeprefix('mcp2026-')} weights"
            series[name] = [
                (r.get("ttft_s"), r.get("e2e_s"), r.get("num_output_tokens"))
                for r in run.records
                if r.get("engine") == engine and r.get("finish_reason") != "error"
            ]
    elif run.kind == "sweep":
        for row in run.records:
            if row.get("requests"):
                series[f"{row['config']} @{row['rate']:g}/s"] = _serve_samples(row["requests"])
    out = {}
    for name, rows in series.items():
        samples = {
            "ttft": [_ms(t) for t, _, _ in rows],
            "tpot": [_tpot_ms(t, e, n) for t, e, n in rows],
            "e2e": [_ms(e) for _, e, _ in rows],
        }
        out[name] = {k: [v for v in values if v is not None] for k, values in samples.items()}
    return out


def rate_series(runs: Sequence[LabelledRun]) -> dict[str, list[tuple[float, float]]]:
    """Output tok/s against offered request rate: a line per sweep config, and one for all serve runs
    against the same server and model."""
    series: dict[str, list[tuple[float, float]]] = {}
    for _, run in runs:
        if run.kind == "serve":
            rate = float(run.config.get("request_rate", math.inf))
            label = f"serve {run.config.get('model')} @ {run.config.get('base_url')}"
            series.setdefault(label, []).append((rate, run.aggregates["output_throughput"]))
        elif run.kind == "sweep":
            for row in run.records:
                if row.get("completed"):
                    series.setdefault(row["config"], []).append((row["rate"], row["output_throughput"]))
    return series


def _front_points(run: BenchRun, y_key: str, front_key: str, latency_key: str) -> list[plots.ParetoPoint]:
    return [
        plots.ParetoPoint(
            row[latency_key], row[y_key], f"{row['config']} @{row['rate']:g}/s", bool(row.get(front_key))
        )
        for row in run.records
        if isinstance(row.get(y_key), (int, float)) and isinstance(row.get(latency_key), (int, float))
    ]


def kv_series(runs: Sequence[LabelledRun]) -> tuple[dict[str, tuple[list, list]], dict[str, int]]:
    """KV blocks held over time: an offline run's timeline, and each sweep row's (config @ rate)."""
    series: dict[str, tuple[list, list]] = {}
    capacity: dict[str, int] = {}
    for label, run in runs:
        timelines = []
        if run.kind.startswith("offline") and run.aggregates.get("kv_timeline"):
            timelines.append((label, run.aggregates["kv_timeline"]))
        if run.kind == "sweep":
            timelines += [
                (f"{row['config']} @{row['rate']:g}/s", row["kv_timeline"])
                for row in run.records
                if row.get("kv_timeline")
            ]
        for name, timeline in timelines:
            series[name] = (timeline["t_s"], timeline["blocks_used"])
            capacity[name] = timeline.get("num_blocks", 0)
    return series, capacity


def kv_share_series(runs: Sequence[LabelledRun]) -> dict[str, tuple[list, list]]:
    """Serve runs: each endpoint's share of its KV pool in use over its load, from its /metrics."""
    series: dict[str, tuple[list, list]] = {}
    for label, run in runs:
        if run.kind != "serve":
            continue
        endpoints = run.aggregates.get("endpoints") or {"": run.aggregates}
        for name, agg in endpoints.items():
            usage = agg.get("kv_usage") or {}
            if usage.get("t_s"):
                series[f"{label} {name}".strip()] = (usage["t_s"], usage["share"])
    return series


def write_figures(
    runs: Sequence[LabelledRun],
    out_dir: str | Path,
    layer_bits: Mapping[str, Mapping[str, float]] | None = None,
) -> Figures:
    """Every plot the runs (and ``layer_bits``: title -> layer -> bits) support, as PNGs in ``out_dir``."""
    out = Path(out_dir)
    figures = Figures()

    def attempt(title: str, filename: str, draw: Callable[[Path], Path]) -> None:
        try:
            figures.paths.append((title, draw(out / filename)))
        except plots.NoPlotData as e:
            figures.skipped.append(f"{title}: {e}")

    samples = {name: values for label, run in runs for name, values in latency_samples(run, label).items()}
    attempt("Latency CDFs", "latency-cdf.png", lambda p: plots.latency_cdfs(samples, p))
    rates = rate_series(runs)
    attempt(
        "Throughput vs request rate", "throughput-vs-rate.png", lambda p: plots.throughput_vs_rate(rates, p)
    )
    sweeps = [(label, run) for label, run in runs if run.kind == "sweep"]
    if not sweeps:
        figures.skipped.append("Pareto fronts (PPL and throughput vs latency): need a sweep run")
    for label, run in sweeps:
        metric = run.config.get("latency_metric", "median_e2el_ms")
        suffix = f"-{label}" if len(sweeps) > 1 else ""
        for title, stem, y_key, front_key, ylabel in FRONTS:
            points = _front_points(run, y_key, front_key, metric)
            attempt(
                f"{title} ({label})",
                f"{stem}{suffix}.png",
                lambda p, pts=points, yl=ylabel, m=metric: plots.pareto_plot(pts, p, m, yl),
            )
    all_bits = dict(layer_bits or {})
    for _, run in runs:
        all_bits.update(run.aggregates.get("layer_bits") or {})
    if not all_bits:
        figures.skipped.append(
            "Bit plan heatmap: no quantized model in these runs; pass --plan ARTIFACT_DIR or plan.json"
        )
    for i, (title, bits) in enumerate(all_bits.items()):
        name = "bit-plan.png" if len(all_bits) == 1 else f"bit-plan-{i + 1}.png"
        attempt(f"Bit plan: {title}", name, lambda p, b=bits, t=title: plots.bit_plan_heatmap(b, p, t))
    series, capacity = kv_series(runs)
    attempt("KV usage over time", "kv-usage.png", lambda p: plots.kv_usage_over_time(series, p, capacity))
    if any(run.kind == "serve" for _, run in runs):
        shares = kv_share_series(runs)
        attempt(
            "KV pool in use while serving",
            "kv-usage-serve.png",
            lambda p: plots.kv_usage_over_time(shares, p, as_share=True),
        )
    return figures


def write_report(
    runs: Sequence[LabelledRun],
    out_dir: str | Path,
    layer_bits: Mapping[str, Mapping[str, float]] | None = None,
) -> tuple[Path, Figures]:
    """``out_dir/report.md``: each run's tables, then the plots (linked by relative path) and what was
    skipped; returns its path and the figures."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    figures = write_figures(runs, out, layer_bits)
    parts = ["# Benchmark report", ""]
    for label, run in runs:
        parts += [f"## {label} ({run.kind})", "", render_markdown(run, heading="###"), ""]
    if figures.paths:
        parts += ["## Plots", ""]
        for title, path in figures.paths:
            parts += [f"### {title}", "", f"![{title}]({path.relative_to(out).as_posix()})", ""]
    if figures.skipped:
        parts += ["Not drawn:", "", *(f"- {reason}" for reason in figures.skipped), ""]
    report = out / "report.md"
    report.write_text("\n".join(parts).rstrip() + "\n")
    return report, figures
