"""``mcp2026 bench report``: earlier runs' summaries, and report.md with plots drawn from them."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from mcp2026.bench.bitplan import read_layer_bits
from mcp2026.bench.cli_common import out
from mcp2026.bench.figures import write_report
from mcp2026.bench.report import read_run, render_markdown
from mcp2026.cli_errors import err, user_errors


@user_errors
def report(
    runs: Annotated[list[Path], typer.Argument(help="run JSON files written by a benchmark")],
    plots: Annotated[
        Path | None,
        typer.Option("--plots", help="folder for report.md + PNG plots (default: <first run>-report/)"),
    ] = None,
    no_plots: Annotated[bool, typer.Option("--no-plots", help="only print the summaries")] = False,
    plan: Annotated[
        Path | None, typer.Option("--plan", help="artifact folder or plan.json: per-layer bit heatmap")
    ] = None,
    model: Annotated[
        str | None, typer.Option("--model", help="with a plan.json: the model it applies to")
    ] = None,
) -> None:
    """Print earlier runs' summaries; write report.md with plots (latency CDFs, throughput vs rate,
    Pareto fronts, bit plan heatmap, KV usage over time)."""
    loaded = [(path.stem, read_run(path)) for path in runs]
    for path, (_, run) in zip(runs, loaded):
        out.print(f"## {path.name}\n", markup=False)
        out.print(render_markdown(run), markup=False, highlight=False)
    if no_plots:
        return
    layer_bits = {plan.name: read_layer_bits(plan, model)} if plan else None
    folder = plots or runs[0].with_name(f"{runs[0].stem}-report")
    path, figures = write_report(loaded, folder, layer_bits)
    err.print(f"[dim]wrote {path} with {len(figures.paths)} plots[/]")
    for reason in figures.skipped:
        err.print(f"[dim]not drawn: {reason}[/]", highlight=False)
