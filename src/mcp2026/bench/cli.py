"""``mcp2026 bench latency | offline | report``: run a benchmark against its peers in the same process, print
the table, write runs/<time>-<kind>.json + .md, optionally refresh docs/benchmarks.md. Heavy imports
(torch, transformers) happen inside the commands so the CLI starts fast.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path
from typing import Annotated

import typer

from mcp2026.bench.cli_common import (
    DocsOpt,
    ModelOpt,
    OutOpt,
    PeerOpt,
    ProgressOpt,
    SeedOpt,
    finish_run,
    out,
    progress_bars,
)
from mcp2026.bench.figures import write_report
from mcp2026.bench.headline_cli import headline
from mcp2026.bench.kv_cli import kv
from mcp2026.bench.latency import LatencyConfig, run_latency
from mcp2026.bench.offline import OfflineConfig, run_offline
from mcp2026.bench.plugin_cli import plugin
from mcp2026.bench.quality_run import quality_run
from mcp2026.bench.report import (
    project_root,
    read_run,
    render_markdown,
    shell_join,
    update_benchmarks_md,
    write_run,
)
from mcp2026.bench.sweep_cli import sweep
from mcp2026.bench.sweep_grid import parse_list
from mcp2026.cli_errors import err, user_errors

bench_app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="QBench: benchmarks of mcp2026 side by side with HF transformers and llama.cpp, same run.",
)


@bench_app.command()
@user_errors
def latency(
    model: ModelOpt = None,
    dtype: Annotated[
        str,
        typer.Option(help="comma-separated: auto (a GGUF's stored formats, the default path), fp32, bf16"),
    ] = "fp32,bf16",
    weights: Annotated[
        str,
        typer.Option(help="also run ours with quantized weights: comma-separated int8, int4, fp8, dqg:BITS"),
    ] = "",
    new_tokens: Annotated[int, typer.Option(help="decode: tokens generated after the prompt")] = 128,
    prefill_tokens: Annotated[int, typer.Option(help="prefill: prompt length")] = 512,
    repeats: Annotated[int, typer.Option(help="measured rounds (median reported)")] = 5,
    warmup: Annotated[int, typer.Option(help="rounds run first and excluded")] = 1,
    seed: SeedOpt = 0,
    peer: PeerOpt = True,
    write_docs: DocsOpt = False,
    out_dir: OutOpt = None,
    progress: ProgressOpt = True,
) -> None:
    """Single-stream decode and prefill tok/s: ours vs HF transformers (interleaved, median of repeats)."""
    dtypes = tuple(d.strip() for d in dtype.split(",") if d.strip())
    formats = tuple(w.strip() for w in weights.split(",") if w.strip())
    config = LatencyConfig(model, dtypes, new_tokens, prefill_tokens, repeats, warmup, peer, seed, formats)
    with progress_bars(progress) as bar:
        run = run_latency(config, bar)
    finish_run(run, out_dir, write_docs, "latency")


@bench_app.command()
@user_errors
def offline(
    model: ModelOpt = None,
    workload: Annotated[str, typer.Option(help="sharegpt | random | prefix | long")] = "sharegpt",
    num_prompts: Annotated[int, typer.Option(help="requests to sample")] = 200,
    max_requests: Annotated[int | None, typer.Option(help="run only the first K sampled requests")] = None,
    seed: SeedOpt = 0,
    dtype: Annotated[str, typer.Option(help="auto | fp32 | bf16 (both engines)")] = "auto",
    peer: PeerOpt = True,
    batch_size: Annotated[int, typer.Option(help="HF static batch size")] = 16,
    batched_decode: Annotated[
        int | None, typer.Option(help="instead: decode tok/s at N concurrent sequences (random workload)")
    ] = None,
    input_len: Annotated[int, typer.Option(help="random workload: prompt tokens")] = 128,
    output_len: Annotated[int, typer.Option(help="random/prefix/long workloads: output tokens")] = 128,
    weights: Annotated[
        str,
        typer.Option(
            help="comma list (int8,int4,bf16,dqg:BITS): also run ours with these weights, same requests"
        ),
    ] = "",
    write_docs: DocsOpt = False,
    out_dir: OutOpt = None,
    progress: ProgressOpt = True,
) -> None:
    """Offline throughput: all requests at once on our engine vs HF static batches, same prompts."""
    config = OfflineConfig(
        model=model,
        workload=workload,
        num_prompts=num_prompts,
        max_requests=max_requests,
        seed=seed,
        dtype=dtype,
        peer=peer,
        batch_size=batch_size,
        input_len=input_len,
        output_len=output_len,
        batched_decode=batched_decode,
        weights=tuple(w for w in weights.split(",") if w),
    )
    with progress_bars(progress) as bar:
        run = run_offline(config, bar)
    section = f"offline-batched-decode-{batched_decode}" if batched_decode else f"offline-{workload}"
    finish_run(run, out_dir, write_docs, section)


@bench_app.command()
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
    from mcp2026.bench.bitplan import (
        read_layer_bits,  # deferred: loads torch; this module stays light for the CLI
    )

    layer_bits = {plan.name: read_layer_bits(plan, model)} if plan else None
    folder = plots or runs[0].with_name(f"{runs[0].stem}-report")
    path, figures = write_report(loaded, folder, layer_bits)
    err.print(f"[dim]wrote {path} with {len(figures.paths)} plots[/]")
    for reason in figures.skipped:
        err.print(f"[dim]not drawn: {reason}[/]", highlight=False)


@bench_app.command()
@user_errors
def quality(
    model: Annotated[Path | None, typer.Option(help="HF folder or .gguf (default: embedded model)")] = None,
    num_windows: Annotated[int, typer.Option(help="512-token windows of held-out ShareGPT text")] = 20,
    only: Annotated[
        str | None, typer.Option(help="comma list: only plans whose name contains one of these")
    ] = None,
    seed: Annotated[int, typer.Option()] = 0,
    out_dir: Annotated[
        Path | None,
        typer.Option(
            "--out", help="where the run JSON, quality.json/.md and the curve PNG go (default: runs/)"
        ),
    ] = None,
    decode_kernels: Annotated[
        bool,
        typer.Option(
            "--decode-kernels/--no-decode-kernels",
            help="feed quantized linears decode-sized row chunks: measure the GEMV kernels generation runs",
        ),
    ] = False,
    peer: Annotated[
        str,
        typer.Option(
            help="peers scored on the same windows: hf (same weights, fp32), llama.cpp (the GGUF as stored, "
            "via llama-cpp-python), comma-separated, or none"
        ),
    ] = "hf,llama.cpp",
    write_docs: Annotated[bool, typer.Option("--write-docs/--no-write-docs")] = False,
) -> None:
    """Perplexity and KLD of quantized plans (int8, int4, role mixture, DQG budgets) vs full precision,
    with HF transformers and llama.cpp scored on the same windows."""
    from mcp2026.bench.quality_peers import (  # deferred: loads torch; this module stays light for the CLI
        PEERS,
        peer_quality_rows,
    )
    from mcp2026.bench.quant_quality import (  # deferred: loads torch; this module stays light for the CLI
        QualityBenchSettings,
        run_quality_bench,
    )

    peers = tuple(p for p in parse_list(peer) if p != "none")
    if set(peers) - set(PEERS):
        err.print(f"[bold red]error:[/] --peer takes {', '.join(PEERS)} or none, got {peer!r}")
        raise typer.Exit(2)
    out_dir = out_dir if out_dir is not None else project_root() / "runs"
    settings = QualityBenchSettings(
        num_windows=num_windows,
        seed=seed,
        only=tuple(s.strip() for s in only.split(",")) if only else (),
        out_dir=str(out_dir),
        decode_kernels=decode_kernels,
        peers=peers,
    )
    rows = partial(peer_quality_rows, model, peers) if peers else None
    result = run_quality_bench(model, settings, peer_rows=rows)
    for note in result.notes:
        err.print(note, style="yellow", markup=False, highlight=False)
    out.print(result.markdown, markup=False, highlight=False)
    command = shell_join(["mcp2026", "bench", "quality", *sys.argv[3:]])
    path = write_run(quality_run(result, settings, command, model), out_dir)
    err.print(f"[dim]wrote {path} (the headline reads it)[/]")
    if write_docs:
        update_benchmarks_md("quality", f"Command: `{command}`\n\n{result.markdown}")


bench_app.command("sweep")(sweep)
bench_app.command("plugin")(plugin)
bench_app.command("kv")(kv)
bench_app.command("headline")(headline)


@bench_app.command("gpu")
@user_errors
def gpu(
    out: Annotated[Path | None, typer.Option(help="write the JSON results here too")] = None,
    docs: Annotated[Path | None, typer.Option(help="rewrite this markdown file's gpu-check section")] = None,
    quick: Annotated[bool, typer.Option(help="skip the 256-sequence and quantized runs")] = False,
) -> None:
    """The GPU check: exactness against HF transformers and speed beside it on one CUDA GPU (SmolLM2-135M's
    shape, random weights, built in the run: no network, no model file)."""
    from mcp2026.bench import gpu_check  # deferred: loads torch and transformers

    gpu_check.main(
        [
            *(["--out", str(out)] if out else []),
            *(["--docs", str(docs)] if docs else []),
            *(["--quick"] if quick else []),
        ]
    )
