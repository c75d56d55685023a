"""``bench_serve``: the serving benchmark against any OpenAI-compatible ``/v1/completions`` endpoint (ours,
llama.cpp's server, vLLM), with the metric definitions of vLLM's ``bench serve`` (vllm/benchmarks/serve.py), so
numbers are comparable across engines; returns a ``BenchRun``.

The parts, one module each: ``serve_config`` (settings, peers, ``--goodput``), ``load_generator`` (arrivals as
vLLM schedules them, the concurrency cap, disconnecting clients and malformed requests), ``serve_metrics`` (TTFT,
ITL, TPOT, E2E, throughputs, percentiles, goodput), ``serve_endpoints`` (model discovery, peer probes, our
server's state afterwards) and ``serve_side_by_side`` (the same workload against ours and each peer in
interleaved phases, with the ratios ours / peer).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from typing import Any

import httpx

from mcp2026.bench.load_generator import LoadGenerator
from mcp2026.bench.report import BenchRun, Table, machine_info
from mcp2026.bench.serve_config import OURS, ServeBenchConfig
from mcp2026.bench.serve_endpoints import discover_model, probe_peer, server_state
from mcp2026.bench.serve_metrics import endpoint_aggregates, prefix_cache_notes, token_source_notes
from mcp2026.bench.serve_side_by_side import bench_side_by_side
from mcp2026.bench.workloads import BenchRequest, describe


def summary_table(metrics: dict[str, Any], config: ServeBenchConfig) -> Any:
    rows: list[list[Any]] = [
        ["successful requests", metrics["completed"]],
        ["failed requests", metrics["failed"]],
        ["duration (s)", metrics["duration_s"]],
        ["request throughput (req/s)", metrics["request_throughput"]],
        ["output token throughput (tok/s)", metrics["output_throughput"]],
        ["total token throughput (tok/s)", metrics["total_token_throughput"]],
    ]
    if config.goodput_ms:
        slos = ", ".join(f"{k} <= {v:g} ms" for k, v in config.goodput_ms.items())
        rows.append([f"request goodput (req/s; {slos})", metrics["request_goodput"]])
    for name, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E")):
        rows.append(
            [
                f"{label} mean / median (ms)",
                f"{metrics[f'mean_{name}_ms']:.1f} / {metrics[f'median_{name}_ms']:.1f}",
            ]
        )
        parts = " / ".join(f"{metrics[f'p{p:g}_{name}_ms']:.1f}" for p in config.percentiles)
        rows.append([f"{label} " + " / ".join(f"p{p:g}" for p in config.percentiles) + " (ms)", parts])
    return Table("serving (vLLM bench-serve definitions)", ["metric", "value"], rows)


def bench_serve(
    config: ServeBenchConfig,
    requests: Sequence[BenchRequest],
    progress: Any = None,
    command: str = "",
    count_tokens: Callable[[str], int] | None = None,
    log: Callable[[str], None] | None = None,
) -> Any:
    """Run the load against ``config.base_url`` and return a ``BenchRun`` (kind "serve"): per-request
    records, vLLM-style aggregates, the 5xx count and (``check_server``) the server's state afterwards.
    With ``config.peers``: the same workload against ours and each reachable peer, interleaved (see
    ``bench_side_by_side``). ``progress``: a rich Progress (or None); ``count_tokens``: output tokens of a
    response whose server reports no usage; ``log``: one-line messages (a peer skipped)."""

    model = config.model or discover_model(config)
    skipped: dict[str, str] = {}
    peers = []
    for peer in config.peers:
        try:
            peers.append(replace(peer, model=probe_peer(peer, config.timeout_s)))
        except Exception as e:  # noqa: BLE001 - an unreachable peer is skipped, the run goes on
            if not isinstance(e, (httpx.HTTPError, ValueError)):
                raise
            skipped[peer.name] = f"{type(e).__name__}: {e}"
            if log is not None:
                log(f"peer {peer.name} skipped: {peer.base_url} is unreachable ({skipped[peer.name]})")
    if peers:
        return bench_side_by_side(
            replace(config, model=model, peers=tuple(peers)),
            requests,
            progress,
            command,
            count_tokens,
            skipped,
        )
    total = len(requests) if config.duration_s is None else None
    task = progress.add_task(f"serve {config.base_url}", total=total) if progress is not None else None
    on_done = (lambda: progress.advance(task)) if progress is not None else None
    generator = LoadGenerator(replace(config, peers=()), model, count_tokens)
    results, duration_s = asyncio.run(generator.run(requests, on_done))
    aggregates = endpoint_aggregates(results, duration_s, config)
    aggregates["kv_usage"] = generator.kv_usage
    if config.check_server:
        aggregates["server_after"] = server_state(config.base_url)
    records = [asdict(r) if config.detailed else {**asdict(r), "itl": None} for r in results]
    notes = []
    if config.disconnect_share or config.malformed_share:
        notes.append(
            f"robustness: {aggregates['num_5xx']} server errors (5xx) over {len(results)} requests; "
            f"statuses by kind {aggregates['statuses']}"
        )
    notes += token_source_notes({OURS: aggregates})
    notes += prefix_cache_notes({OURS: aggregates})
    notes += [f"peer {name} skipped: unreachable ({why})" for name, why in skipped.items()]
    return BenchRun(
        kind="serve",
        command=command,
        config={
            **asdict(config),
            "model": model,
            "workload": describe(list(requests)),
            "skipped_peers": skipped,
        },
        records=records,
        aggregates=aggregates,
        tables=[summary_table(aggregates, config)],
        notes=notes,
        machine=machine_info(),
    )
