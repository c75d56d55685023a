"""``mcp2026 doctor``: pre-flight checks before serving (runtime, memory, model, KV layout, serving)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from mcp2026.cli_errors import err, user_errors
from mcp2026.doctor.checks import run_doctor
from mcp2026.doctor.context import DoctorContext
from mcp2026.doctor.report import exit_code, summary_line, to_json, to_table


@user_errors
def doctor(
    config: Annotated[
        Path | None, typer.Option("--config", help="serve YAML to check (as for `serve`)")
    ] = None,
    model: Annotated[
        Path | None,
        typer.Option(
            "--model", "-m", help="HF folder or .gguf (default: the config's, else the embedded model)"
        ),
    ] = None,
    url: Annotated[
        str | None, typer.Option("--url", help="a running server to probe: GET /healthz and /readyz")
    ] = None,
    ca_bundle: Annotated[
        Path | None, typer.Option("--ca-bundle", help="PEM CA certificates the TLS chain must verify against")
    ] = None,
    quick: Annotated[
        bool,
        typer.Option("--quick", help="skip measurements not cached yet (kernel speed, bandwidth, weights)"),
    ] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="print a JSON document instead of the table")
    ] = False,
) -> None:
    """Pre-flight checks: PASS / WARN / FAIL with a reason and a fix each; exit code 1 on any FAIL.

    The first full run measures the quant kernels, the memory bandwidth and the model's weight
    statistics (tens of seconds on a small CPU); later runs read them from the cache."""
    if ca_bundle is not None and not ca_bundle.is_file():
        raise FileNotFoundError(f"--ca-bundle {ca_bundle}: no such file")
    ctx = DoctorContext.from_options(config, model, url, ca_bundle, quick)
    if not quick and not as_json:
        err.print(
            "[dim]measuring what is not cached yet (quant kernels, bandwidth, weight statistics); --quick skips it[/]"
        )
    start = time.perf_counter()
    with err.status("running checks"):
        results = run_doctor(ctx)
    elapsed = time.perf_counter() - start
    if as_json:
        sys.stdout.write(to_json(results, elapsed) + "\n")
    else:
        out = Console()
        out.print(to_table(results))
        out.print(summary_line(results, elapsed), highlight=False)
    raise typer.Exit(exit_code(results))
