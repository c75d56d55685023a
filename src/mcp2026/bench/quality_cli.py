"""``mcp2026 bench quality``: perplexity and KLD of quantized plans, with peers scored on the same windows."""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path
from typing import Annotated

import typer

from mcp2026.bench.cli_common import out
from mcp2026.bench.llama_cpp_quantize import DEFAULT_LLAMA_CPP_TYPES, LLAMA_CPP_FILE_TYPES
from mcp2026.bench.quality_peers import PEERS, peer_quality_rows
from mcp2026.bench.quality_run import quality_run
from mcp2026.bench.quant_quality import QualityBenchSettings, run_quality_bench
from mcp2026.bench.report import project_root, shell_join, update_benchmarks_md, write_run
from mcp2026.bench.sweep_grid import parse_list
from mcp2026.cli_errors import err, user_errors


@user_errors
def quality(
    model: Annotated[Path | None, typer.Option(help="HF folder or .gguf (default: embedded model)")] = None,
    num_windows: Annotated[int, typer.Option(help="512-token windows of held-out ShareGPT text")] = 20,
    only: Annotated[
        str | None,
        typer.Option(
            help="comma list: only plans whose name contains one of these (=NAME: that name exactly)"
        ),
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
            "via llama-cpp-python), llama.cpp:TYPE (the GGUF re-quantized by llama.cpp to TYPE: "
            f"{', '.join(LLAMA_CPP_FILE_TYPES)}), comma-separated, or none"
        ),
    ] = "hf,llama.cpp," + ",".join(f"llama.cpp:{t}" for t in DEFAULT_LLAMA_CPP_TYPES),
    write_docs: Annotated[bool, typer.Option("--write-docs/--no-write-docs")] = False,
) -> None:
    """Perplexity and KLD of quantized plans (int8, int4, role mixture, DQG budgets) vs full precision,
    with HF transformers, llama.cpp and llama.cpp's own formats scored on the same windows."""
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
