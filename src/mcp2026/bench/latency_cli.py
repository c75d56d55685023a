"""``mcp2026 bench latency``: single-stream decode and prefill speed, ours beside HF transformers (and llama.cpp)."""

from __future__ import annotations

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
    progress_bars,
)
from mcp2026.bench.latency import LatencyConfig, run_latency
from mcp2026.cli_errors import user_errors


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
    speculative: Annotated[
        bool,
        typer.Option(
            help="ours drafts by prompt lookup, as by default (exact: the same tokens); --no-speculative: plain "
            "decoding, one token a step"
        ),
    ] = True,
    context_tokens: Annotated[
        int,
        typer.Option(
            help="decode after this many tokens of held-out ShareGPT conversations instead of the short chat "
            "prompt (0)"
        ),
    ] = 0,
    write_docs: DocsOpt = False,
    out_dir: OutOpt = None,
    progress: ProgressOpt = True,
) -> None:
    """Single-stream decode and prefill tok/s: ours vs HF transformers (interleaved, median of repeats)."""
    dtypes = tuple(d.strip() for d in dtype.split(",") if d.strip())
    formats = tuple(w.strip() for w in weights.split(",") if w.strip())
    config = LatencyConfig(
        model,
        dtypes,
        new_tokens,
        prefill_tokens,
        repeats,
        warmup,
        peer,
        seed,
        formats,
        speculative,
        context_tokens,
    )
    with progress_bars(progress) as bar:
        run = run_latency(config, bar)
    section = f"latency-context-{context_tokens}" if context_tokens else "latency"
    finish_run(run, out_dir, write_docs, section)
