"""``mcp2026 bench headline``: the headline table (bench/headline.py) from run JSONs, printed and optionally
spliced into docs/benchmarks.md. Listed on the bench app by bench/cli.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from mcp2026.bench import report
from mcp2026.bench.cli_common import out
from mcp2026.bench.headline import headline_markdown
from mcp2026.bench.report import BenchRun, read_benchmarks_section, update_benchmarks_md
from mcp2026.cli_errors import err, user_errors


def load_run(path: Path) -> BenchRun:
    """A ``BenchRun`` from ``path``; ValueError naming the file when it is not a run JSON."""
    try:
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict) or not isinstance(data.get("kind"), str):
            raise ValueError("no 'kind'")
        run = BenchRun.from_dict(data)
        if not isinstance(run.aggregates, dict) or not isinstance(run.config, dict):
            raise ValueError("'aggregates' and 'config' must be objects")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot read it ({e})") from None
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"{path}: not a benchmark run JSON ({e})") from None
    return run


@user_errors
def headline(
    runs: Annotated[
        list[Path] | None, typer.Argument(help="run JSON files (default: every *.json in --runs-dir)")
    ] = None,
    runs_dir: Annotated[
        Path | None, typer.Option("--runs-dir", help="where the runs are (default: the project's runs/)")
    ] = None,
    write_docs: Annotated[
        bool,
        typer.Option(
            "--write-docs/--no-write-docs", help="replace the headline section of docs/benchmarks.md"
        ),
    ] = False,
    keep_missing: Annotated[
        bool,
        typer.Option(
            "--keep-missing/--drop-missing",
            help="a kind with no run keeps its rows from the current table in docs/benchmarks.md (default)",
        ),
    ] = True,
) -> None:
    """The headline table (ours vs HF transformers, llama.cpp, vLLM) from the newest run of each kind."""
    if runs:
        loaded = [load_run(path) for path in runs]
    else:
        folder = runs_dir if runs_dir is not None else report.project_root() / "runs"  # looked up per call
        if not folder.is_dir():
            raise ValueError(f"no runs folder {folder} (give run JSON files or --runs-dir)")
        loaded = []
        for path in sorted(folder.glob("*.json")):  # name order: the later file wins a tie
            try:
                loaded.append(load_run(path))
            except ValueError as e:
                err.print(f"[yellow]skipped[/] {escape(str(e))}", highlight=False)
    markdown = headline_markdown(loaded, read_benchmarks_section("headline") if keep_missing else "")
    out.print(markdown, markup=False, highlight=False)
    if write_docs:
        err.print(f"[dim]updated {update_benchmarks_md('headline', markdown)} (section headline)[/]")
