"""``mcp2026 bench soak``: start-up time and resident memory of ``mcp2026 serve`` under long ShareGPT load."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from mcp2026.bench.cli_common import (
    DocsOpt,
    ModelOpt,
    OutOpt,
    ProgressOpt,
    SeedOpt,
    finish_run,
    progress_bars,
)
from mcp2026.bench.serve_cli import load_tokenizer
from mcp2026.bench.soak import SoakConfig, run_soak
from mcp2026.bench.workloads import WorkloadSpec, load_workload
from mcp2026.cli_errors import user_errors


@user_errors
def soak(
    model: ModelOpt = None,
    duration: Annotated[float, typer.Option(help="seconds of load")] = 1800.0,
    max_concurrency: Annotated[int, typer.Option(help="streams in flight")] = 64,
    disconnect_share: Annotated[float, typer.Option(help="share of clients that hang up mid-stream")] = 0.2,
    malformed_share: Annotated[float, typer.Option(help="share of requests with a broken body")] = 0.1,
    warmup: Annotated[float, typer.Option(help="seconds of load before the RSS slope is fitted")] = 120.0,
    num_prompts: Annotated[int, typer.Option(help="ShareGPT requests, cycled for the duration")] = 400,
    serve_arg: Annotated[
        list[str] | None,
        typer.Option(help="an option for `mcp2026 serve` (repeatable), e.g. --serve-arg=--dtype=fp32"),
    ] = None,
    seed: SeedOpt = 0,
    write_docs: DocsOpt = False,
    out_dir: OutOpt = None,
    progress: ProgressOpt = True,
) -> None:
    """Start-up seconds and RSS over time of `mcp2026 serve` under long ShareGPT load with hang-ups and malformed
    requests."""
    config = SoakConfig(
        model=str(model) if model else None,
        duration_s=duration,
        max_concurrency=max_concurrency,
        disconnect_share=disconnect_share,
        malformed_share=malformed_share,
        warmup_s=warmup,
        seed=seed,
        serve_args=tuple(serve_arg or ()),
    )
    tokenizer = load_tokenizer(str(model) if model else None)
    requests = load_workload(WorkloadSpec("sharegpt", num_prompts, seed), tokenizer)
    with progress_bars(progress) as bar:
        run = run_soak(config, requests, Path(out_dir or "runs") / "soak-logs", bar)
    finish_run(run, out_dir, write_docs, "soak")
