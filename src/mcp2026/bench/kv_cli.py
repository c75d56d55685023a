"""``mcp2026 bench kv``: the KV-compression benchmark (see bench/kv.py). Listed on the bench app by
bench/cli.py. Options left out keep the defaults of ``KVBenchConfig`` (or of the ``--quick`` grid)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from mcp2026.bench.cli_common import finish_run, progress_bars
from mcp2026.bench.kv import run_kv
from mcp2026.bench.kv_config import make_config
from mcp2026.bench.sweep_grid import parse_list
from mcp2026.cli_errors import err, user_errors


def _names(text: str | None) -> tuple[str, ...] | None:
    """A comma list; "none" is the empty list; None (not given) stays None."""
    if text is None:
        return None
    names = parse_list(text)
    return () if names == ("none",) else names


def _floats(option: str, text: str | None) -> tuple[float, ...] | None:
    return None if text is None else parse_list(text, float, option)


@user_errors
def kv(
    model: Annotated[
        str | None, typer.Option("--model", "-m", help="HF folder or .gguf (default: embedded SmolLM2-135M)")
    ] = None,
    dtype: Annotated[
        str | None, typer.Option(help="fp32 (default) | bf16: activations and reference KV")
    ] = None,
    context_tokens: Annotated[
        int | None, typer.Option(help="tokens per sequence, up to 8192 (default 2048; --quick 1024)")
    ] = None,
    num_sequences: Annotated[
        int | None, typer.Option(help="long sequences to average over (default 1)")
    ] = None,
    codecs: Annotated[
        str | None, typer.Option(help="comma list of KV codecs, or none (default int8,int4,fp8)")
    ] = None,
    policies: Annotated[
        str | None,
        typer.Option(
            help="comma list of eviction policies, or none "
            "(default sink_window,heavy_hitter,snap,dynamic_window)"
        ),
    ] = None,
    sparsities: Annotated[
        str | None, typer.Option(help="comma list, fraction dropped (default 0.5,0.7,0.9)")
    ] = None,
    combined: Annotated[
        str | None,
        typer.Option(
            help="comma list of codec + eviction rows, e.g. int4+heavy_hitter@0.7 (KVCompressor fields as "
            "options: int4+heavy_hitter@0.7:num_anchors=0), or none (default none)"
        ),
    ] = None,
    block_size: Annotated[
        int | None,
        typer.Option(
            help="KV block size in tokens for every config (default: each codec's: 16; int4 32, int4-g64 64)"
        ),
    ] = None,
    chunk_size: Annotated[
        int | None,
        typer.Option(help="teacher-forced chunk after the prompt half; 1 = token by token (default 32)"),
    ] = None,
    retrieval_seeds: Annotated[
        int | None, typer.Option(help="retrieval prompts; 0 skips (default 50)")
    ] = None,
    retrieval_tokens: Annotated[
        int | None, typer.Option(help="retrieval prompt length (default 1024)")
    ] = None,
    retrieval_configs: Annotated[
        str | None,
        typer.Option(
            help="configs checked for retrieval, e.g. int4,heavy_hitter@0.7,snap@0.7:lookahead_tokens=16 "
            "(default heavy_hitter@0.7)"
        ),
    ] = None,
    budget_gb: Annotated[
        float | None, typer.Option(help="KV memory budget for max sequences (default 1)")
    ] = None,
    concurrent_len: Annotated[
        int | None, typer.Option(help="sequence length for max sequences (default 2048)")
    ] = None,
    decode_context: Annotated[
        int | None, typer.Option(help="decode tok/s at this context; 0 skips (default 4096; --quick 1024)")
    ] = None,
    decode_tokens: Annotated[int | None, typer.Option(help="decode steps timed (default 32)")] = None,
    decode_policy: Annotated[
        str | None, typer.Option(help="policy at 70% sparsity for decode tok/s (default heavy_hitter)")
    ] = None,
    decode_weights: Annotated[
        str | None,
        typer.Option(
            help="weights for decode tok/s: int8 | int4 | fp8 | dqg:BITS (default: as loaded, --dtype)"
        ),
    ] = None,
    decode_configs: Annotated[
        str | None,
        typer.Option(
            help="more configs timed for decode tok/s, each vs uncompressed, e.g. int8,int4,"
            "int4+heavy_hitter@0.7 (default none)"
        ),
    ] = None,
    text: Annotated[str | None, typer.Option(help="sharegpt (default) | random token ids")] = None,
    seed: Annotated[int | None, typer.Option(help="text and retrieval seed (default 0)")] = None,
    llama_cpp_kv: Annotated[
        str | None,
        typer.Option(
            help="llama.cpp's own KV cache types scored on the same sequences, each against its f16 cache "
            "(needs llama-cpp-python), or none (default q8_0,q4_0)"
        ),
    ] = None,
    quick: Annotated[bool, typer.Option("--quick", help="a small grid: int8,int4, heavy_hitter@0.7")] = False,
    write_docs: Annotated[
        bool,
        typer.Option("--write-docs/--no-write-docs", help="replace the kv section of docs/benchmarks.md"),
    ] = False,
    out_dir: Annotated[
        Path | None, typer.Option("--out", help="folder for the run's JSON and markdown (default: runs/)")
    ] = None,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="show progress bars")] = True,
) -> None:
    """KV compression: ΔPPL / KLD per codec and eviction policy, retrieval agreement, KV bytes and max
    concurrent sequences, decode tok/s with eviction, each vs uncompressed in the same engine."""
    config = make_config(
        quick,
        model=model,
        dtype=dtype,
        context_tokens=context_tokens,
        num_sequences=num_sequences,
        codecs=_names(codecs),
        policies=_names(policies),
        sparsities=_floats("--sparsities", sparsities),
        combined=_names(combined),
        block_size=block_size,
        chunk_size=chunk_size,
        retrieval_seeds=retrieval_seeds,
        retrieval_tokens=retrieval_tokens,
        retrieval_configs=_names(retrieval_configs),
        budget_gb=budget_gb,
        concurrent_len=concurrent_len,
        decode_context=decode_context,
        decode_tokens=decode_tokens,
        decode_policy=decode_policy,
        decode_weights=decode_weights,
        decode_configs=_names(decode_configs),
        text=text,
        seed=seed,
        llama_cpp_kv=_names(llama_cpp_kv),
    )
    with progress_bars(progress) as bar:
        run = run_kv(config, bar, lambda message: err.print(f"[dim]{message}[/]", highlight=False))
    finish_run(run, out_dir, write_docs, "kv")
