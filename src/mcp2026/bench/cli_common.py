"""What the ``mcp2026 bench`` commands share: the output console, option types, progress bars and writing a
run. Its own module so the commands kept in other files need not import the bench app that registers them."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from mcp2026.bench.report import render_markdown, update_benchmarks_md, write_run
from mcp2026.cli_errors import err

out = Console(soft_wrap=True, emoji=False)  # markdown lines must not be wrapped

ModelOpt = Annotated[
    str | None, typer.Option("--model", "-m", help="HF folder or .gguf (default: embedded SmolLM2-135M)")
]
SeedOpt = Annotated[int, typer.Option(help="workload seed")]
PeerOpt = Annotated[bool, typer.Option("--peer/--no-peer", help="run HF transformers (and llama.cpp) too")]
DocsOpt = Annotated[
    bool,
    typer.Option(
        "--write-docs/--no-write-docs", help="replace this benchmark's section of docs/benchmarks.md"
    ),
]
OutOpt = Annotated[
    Path | None, typer.Option("--out", help="folder for the run's JSON and markdown (default: runs/)")
]
ProgressOpt = Annotated[bool, typer.Option("--progress/--no-progress", help="show progress bars")]


def progress_bars(enabled: bool) -> Any:
    if not enabled:
        return nullcontext(None)

    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=err
    )


def finish_run(run: Any, out_dir: Path | None, write_docs: bool, section: str) -> Path:
    markdown = render_markdown(run)
    out.print(markdown, markup=False, highlight=False)
    path = write_run(run, out_dir)
    err.print(f"[dim]wrote {path} and {path.with_suffix('.md').name}[/]")
    if write_docs:
        err.print(f"[dim]updated {update_benchmarks_md(section, markdown)} (section {section})[/]")
    return path
