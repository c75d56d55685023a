"""``mcp2026 bench export``: our perplexity against llama.cpp's on a plan exported to GGUF."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from mcp2026.bench.cli_common import out
from mcp2026.bench.export_check import run_export_check
from mcp2026.bench.report import shell_join
from mcp2026.cli_errors import user_errors


@user_errors
def export(
    model: Annotated[Path | None, typer.Option(help="HF folder or .gguf (default: embedded model)")] = None,
    num_windows: Annotated[int, typer.Option(help="512-token windows of held-out ShareGPT text")] = 4,
    symmetric: Annotated[
        bool, typer.Option("--symmetric/--asymmetric", help="int4 body: Q4_0 or Q4_1")
    ] = False,
) -> None:
    """A plan exported to GGUF: its perplexity in llama.cpp against ours on the same held-out windows. The plan is
    int4 g32 with an int8 lm_head; the gap says whether the file holds the model we run."""
    result = run_export_check(model, num_windows, symmetric)
    out.print(f"Command: `{shell_join(['mcp2026', 'bench', 'export', *sys.argv[3:]])}`\n", markup=False)
    out.print(result.markdown(), markup=False, highlight=False)
    for line in result.summary:
        out.print(f"export: {line}", markup=False, highlight=False)
