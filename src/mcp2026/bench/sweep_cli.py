"""``mcp2026 bench sweep``: a grid of serving configurations x request rates (see bench/sweep.py).
Listed on the bench app by bench/cli.py."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated

import typer

from mcp2026.bench.cli_common import finish_run, progress_bars
from mcp2026.bench.figures import write_report
from mcp2026.bench.report import shell_join
from mcp2026.bench.serve_config import parse_goodput
from mcp2026.bench.sweep import SweepConfig, run_sweep
from mcp2026.bench.sweep_grid import GridAxes, build_grid, parse_list
from mcp2026.bench.workloads import workload_burstiness
from mcp2026.cli_errors import err, user_errors


def _rates(text: str) -> tuple[float, ...]:
    try:
        rates = tuple(math.inf if s.strip() == "inf" else float(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise ValueError(f"--rates: expected comma-separated requests/s (or inf), got {text!r}") from None
    if not rates:
        raise ValueError("--rates: give at least one request rate, e.g. 1,2,4")
    return rates


@user_errors
def sweep(
    rates: Annotated[str, typer.Option(help="comma-separated requests/s (inf: all at once)")] = "1,2,4",
    configs: Annotated[
        str | None, typer.Option(help="comma-separated serve YAMLs (mcp2026 serve --config format)")
    ] = None,
    model: Annotated[str | None, typer.Option("--model", "-m", help="model for every config")] = None,
    dtype: Annotated[str | None, typer.Option(help="auto | fp32 | bf16 for every config")] = None,
    max_num_seqs: Annotated[str | None, typer.Option(help="grid axis, e.g. 8,32")] = None,
    max_num_batched_tokens: Annotated[str | None, typer.Option(help="grid axis, e.g. 512,2048")] = None,
    kv_dtype: Annotated[str | None, typer.Option(help="grid axis of KV codecs, e.g. none,int8,int4")] = None,
    kv_policy: Annotated[
        str | None, typer.Option(help="grid axis of KV eviction policies, e.g. none,heavy_hitter")
    ] = None,
    kv_sparsity: Annotated[float | None, typer.Option(help="sparsity for the --kv-policy values")] = None,
    quant: Annotated[
        str | None, typer.Option(help="grid axis of QuantConfig YAMLs, e.g. none,examples/quant/w8.yaml")
    ] = None,
    workload: Annotated[str, typer.Option(help="random | sharegpt | bursty | prefix | long")] = "random",
    burstiness: Annotated[
        float | None, typer.Option(help="Gamma shape: 1 = Poisson, < 1 burstier (default: the workload's)")
    ] = None,
    num_prompts: Annotated[int, typer.Option(help="requests per (config, rate)")] = 16,
    input_len: Annotated[int, typer.Option(help="random workload: prompt tokens")] = 128,
    output_len: Annotated[int, typer.Option(help="tokens generated per request")] = 32,
    max_concurrency: Annotated[int | None, typer.Option(help="requests in flight at most")] = None,
    goodput: Annotated[
        list[str] | None,
        typer.Option(help="SLO for goodput, repeated or comma-separated: ttft:MS, tpot:MS, e2el:MS"),
    ] = None,
    quality_windows: Annotated[
        int, typer.Option(help="held-out 512-token windows for each config's perplexity (0: none)")
    ] = 2,
    latency_metric: Annotated[
        str, typer.Option(help="latency axis of the fronts, e.g. median_e2el_ms, p99_tpot_ms")
    ] = "median_e2el_ms",
    seed: Annotated[int, typer.Option(help="workload and arrival seed")] = 0,
    out_dir: Annotated[Path | None, typer.Option("--out", help="folder for the run (default: runs/)")] = None,
    plots: Annotated[bool, typer.Option("--plots/--no-plots", help="write the plots next to the run")] = True,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="show progress bars")] = True,
) -> None:
    """Serve each configuration at each request rate; table, Pareto fronts and plots."""
    config = SweepConfig(
        rates=_rates(rates),
        workload=workload,
        burstiness=burstiness if burstiness is not None else workload_burstiness(workload),
        num_prompts=num_prompts,
        input_len=input_len,
        output_len=output_len,
        seed=seed,
        max_concurrency=max_concurrency,
        goodput_ms=parse_goodput(goodput or []),
        quality_windows=quality_windows,
        latency_metric=latency_metric,
    )
    axes = GridAxes(
        max_num_seqs=parse_list(max_num_seqs, int, "--max-num-seqs"),
        max_num_batched_tokens=parse_list(max_num_batched_tokens, int, "--max-num-batched-tokens"),
        kv_dtypes=parse_list(kv_dtype, str, "--kv-dtype"),
        kv_policies=parse_list(kv_policy, str, "--kv-policy"),
        kv_sparsity=kv_sparsity,
        quants=parse_list(quant, str, "--quant"),
    )
    points = build_grid([Path(p) for p in parse_list(configs, str, "--configs")], axes, model, dtype)
    err.print(f"[dim]sweep: {len(points)} configs x {len(config.rates)} rates x {num_prompts} prompts[/]")
    options = {
        "--rates": rates, "--configs": configs, "--model": model, "--dtype": dtype, "--max-num-seqs": max_num_seqs,
        "--max-num-batched-tokens": max_num_batched_tokens, "--kv-dtype": kv_dtype, "--kv-policy": kv_policy,
        "--kv-sparsity": kv_sparsity, "--quant": quant, "--workload": workload, "--num-prompts": num_prompts,
        "--burstiness": burstiness, "--input-len": input_len, "--output-len": output_len,
        "--max-concurrency": max_concurrency,
        "--quality-windows": quality_windows, "--latency-metric": latency_metric, "--seed": seed,
    }  # fmt: skip
    args = [str(a) for flag, value in options.items() if value is not None for a in (flag, value)]
    args += [a for slo in goodput or [] for a in ("--goodput", slo)]
    command = shell_join(["mcp2026", "bench", "sweep", *args])
    with progress_bars(progress) as bar:
        run = run_sweep(config, points, bar, command=command)
    path = finish_run(run, out_dir, False, "sweep")
    if plots:
        report, figures = write_report([(path.stem, run)], path.with_name(f"{path.stem}-report"))
        err.print(f"[dim]wrote {report} with {len(figures.paths)} plots[/]")
        for reason in figures.skipped:
            err.print(f"[dim]not drawn: {reason}[/]", highlight=False)
