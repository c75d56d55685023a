"""``mcp2026 canary --baseline A.yaml --candidate B.yaml``: the release gate. Exit codes: 0 PROMOTE, 1 HOLD,
2 ROLLBACK, 3 bad input (files, values, options), so CI pipelines can branch on the verdict."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from typer.core import TyperCommand

from mcp2026.bench.canary_report import render_markdown, write_report
from mcp2026.bench.canary_run import CanarySettings, run_canary
from mcp2026.canary.gate import BAD_INPUT_EXIT_CODE
from mcp2026.cli_errors import err, user_errors

out = Console(soft_wrap=True, emoji=False)  # markdown lines must not be wrapped


class CanaryCommand(TyperCommand):
    """Option parsing errors exit 3 too (click's usual 2 would read as ROLLBACK)."""

    def make_context(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().make_context(*args, **kwargs)
        except Exception as e:
            if getattr(e, "exit_code", None) == 2:  # a UsageError (typer vendors click, so no import)
                e.exit_code = BAD_INPUT_EXIT_CODE
            raise


@user_errors(exit_code=BAD_INPUT_EXIT_CODE)
def canary(
    baseline: Annotated[
        Path | None, typer.Option(help="serve YAML of the configuration in production")
    ] = None,
    candidate: Annotated[Path | None, typer.Option(help="serve YAML of the configuration to release")] = None,
    workload: Annotated[str, typer.Option(help="sharegpt | random")] = "sharegpt",
    num_prompts: Annotated[int, typer.Option(help="requests, each run on both arms")] = 24,
    max_tokens: Annotated[int, typer.Option(help="cap on each request's output tokens")] = 32,
    input_len: Annotated[int, typer.Option(help="random workload: prompt tokens")] = 128,
    output_len: Annotated[int, typer.Option(help="random workload: output tokens")] = 32,
    block_size: Annotated[int, typer.Option(help="requests per interleaved block (submitted together)")] = 4,
    seed: Annotated[int, typer.Option(help="workload sample and bootstrap seed")] = 0,
    eval_windows: Annotated[
        int, typer.Option(help="held-out text windows for the accuracy delta (0: skip; the verdict holds)")
    ] = 4,
    eval_ctx: Annotated[int, typer.Option(help="tokens per evaluation window")] = 512,
    thresholds: Annotated[
        Path | None, typer.Option("--thresholds", help="YAML overriding the decision matrix")
    ] = None,
    out_dir: Annotated[
        Path | None, typer.Option("--out", help="folder for the report's JSON and markdown (default: runs/)")
    ] = None,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="say what runs")] = True,
) -> None:
    """Release gate: run two configurations on the same requests (interleaved) and decide PROMOTE / HOLD /
    ROLLBACK from P99 latency change, accuracy delta and memory bandwidth utilisation."""
    if baseline is None or candidate is None:
        raise ValueError("give --baseline A.yaml and --candidate B.yaml (serve YAMLs, see examples/canary/)")
    settings = CanarySettings(
        baseline=str(baseline),
        candidate=str(candidate),
        workload=workload,
        num_prompts=num_prompts,
        max_tokens=max_tokens,
        input_len=input_len,
        output_len=output_len,
        block_size=block_size,
        seed=seed,
        eval_windows=eval_windows,
        eval_ctx=eval_ctx,
        thresholds_file=None if thresholds is None else str(thresholds),
    )
    say = (lambda m: err.print(f"[dim]{m}[/]", highlight=False)) if progress else (lambda _m: None)
    result = run_canary(settings, say)
    json_path, md_path, report = write_report(result, out_dir)
    out.print(render_markdown(report), markup=False, highlight=False)
    err.print(f"[dim]wrote {json_path} and {md_path.name}[/]", highlight=False)
    raise typer.Exit(result.gate.exit_code)


canary_app = typer.Typer(add_completion=False)
canary_app.command("canary", cls=CanaryCommand)(canary)
