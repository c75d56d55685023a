"""Serving side by side: the same workload against our server and each peer in interleaved phases
(A B | B A | ...), each endpoint's aggregates, the ratios ours / peer overall and per round, and their tables.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from typing import Any

from mcp2026.bench.kv_usage import join_phases
from mcp2026.bench.load_generator import LoadGenerator, PhaseResult
from mcp2026.bench.report import BenchRun, Table, machine_info
from mcp2026.bench.serve_config import OURS, ServeBenchConfig
from mcp2026.bench.serve_endpoints import server_state
from mcp2026.bench.serve_metrics import (
    RequestResult,
    endpoint_aggregates,
    prefix_cache_notes,
    token_source_notes,
)
from mcp2026.bench.workloads import BenchRequest, describe

RATIO_PREFIXES = ("mean_", "median_", "p")


def phase_schedule(names: Sequence[str], rounds: int) -> list[tuple[int, str]]:
    """(round, endpoint) in the order the phases run: every endpoint once per round, every other round in
    reverse (A B | B A | A B ...), so a machine that drifts slower or faster weighs on all endpoints alike."""
    order = []
    for r in range(rounds):
        order += [(r, name) for name in (names if r % 2 == 0 else list(reversed(names)))]
    return order


def block_bounds(num: int, rounds: int) -> list[tuple[int, int]]:
    """The request list split into ``rounds`` contiguous blocks as even as can be (``[start, stop)``)."""
    if not 1 <= rounds <= num:
        raise ValueError(f"rounds must be in [1, number of requests = {num}], got {rounds}")
    cuts = [num * r // rounds for r in range(rounds + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


def _ratio(ours: Any, peer: Any) -> float | None:
    if not isinstance(ours, (int, float)) or not isinstance(peer, (int, float)) or isinstance(ours, bool):
        return None
    return float(ours) / float(peer) if peer > 0 else None


def compute_ratios(ours: dict[str, Any], peer: dict[str, Any]) -> dict[str, float | None]:
    """ours / peer for the throughputs, the goodput and every mean/median/percentile latency (ms); None
    where the peer's value is 0 or missing. Above 1: ours is higher (better for throughputs, worse for
    latencies)."""
    keys = ["request_throughput", "request_goodput", "output_throughput", "total_token_throughput"]
    keys += [k for k in ours if k.endswith("_ms") and k.startswith(RATIO_PREFIXES) and k in peer]
    return {k: _ratio(ours.get(k), peer.get(k)) for k in keys}


def phase_row(k: int, r: int, name: str, start: int, phase: PhaseResult) -> dict[str, Any]:
    done = [x for x in phase.results if x.kind == "normal" and x.success]
    tokens = sum(x.output_tokens for x in done)
    return {
        "phase": k,
        "round": r,
        "endpoint": name,
        "first_index": start,
        "next_index": phase.next_index,
        "num_sent": len(phase.results),
        "completed": len(done),
        "seconds": phase.seconds,
        "output_tokens": tokens,
        "output_throughput": tokens / phase.seconds if phase.seconds > 0 else 0.0,
    }


def round_ratios(phases: Sequence[dict[str, Any]], peer: str, key: str = "output_throughput") -> list:
    """ours / peer of ``key`` in each round (their spread shows how noisy the machine was)."""
    by = {(p["round"], p["endpoint"]): p[key] for p in phases}
    rounds = sorted({p["round"] for p in phases})
    return [_ratio(by.get((r, OURS)), by.get((r, peer))) for r in rounds]


async def run_interleaved(
    generators: dict[str, LoadGenerator],
    requests: Sequence[BenchRequest],
    config: ServeBenchConfig,
    on_done: Callable[[str], None] | None = None,
) -> tuple[dict[str, list[RequestResult]], dict[str, float], list[dict[str, Any]]]:
    """Every endpoint's phases in ``phase_schedule`` order, one at a time (a phase ends when its last
    request has). Duration mode: each phase lasts ``duration_s / rounds`` and an endpoint's next phase
    continues its request sequence where the last one stopped; otherwise block r of the requests goes to
    every endpoint in round r. Returns results and summed phase seconds per endpoint, and the phase rows."""
    names = list(generators)
    results: dict[str, list[RequestResult]] = {n: [] for n in names}
    kv_usage: dict[str, list] = {n: [] for n in names}
    seconds = dict.fromkeys(names, 0.0)
    next_index = dict.fromkeys(names, 0)
    phases = []
    blocks = None if config.duration_s is not None else block_bounds(len(requests), config.rounds)
    for k, (r, name) in enumerate(phase_schedule(names, config.rounds)):
        done = (lambda n=name: on_done(n)) if on_done is not None else None
        if blocks is None:
            start, stop, limit = next_index[name], config.max_requests, config.duration_s / config.rounds
        else:
            (start, stop), limit = blocks[r], None
        phase = await generators[name].run_phase(requests, start, stop, limit, done)
        next_index[name] = phase.next_index
        for x in phase.results:
            x.endpoint, x.phase = name, k
        results[name] += phase.results
        kv_usage[name].append((seconds[name], phase.kv_usage))
        seconds[name] += phase.seconds
        phases.append(phase_row(k, r, name, start, phase))
    for name in names:
        generators[name].kv_usage = join_phases(kv_usage[name])
    return results, seconds, phases


def bench_side_by_side(
    config: ServeBenchConfig,
    requests: Sequence[BenchRequest],
    progress: Any = None,
    command: str = "",
    count_tokens: Callable[[str], int] | None = None,
    skipped: dict[str, str] | None = None,
) -> Any:
    """Ours (``config.base_url``, named ``mcp2026``) and each of ``config.peers`` (models resolved) under
    the same workload: same requests, seeds, max tokens, concurrency and arrival process, in interleaved
    phases. Disconnecting clients, malformed requests and ``check_server`` apply to ours only. Aggregates:
    ours at the top level (as a single run), every endpoint's under ``endpoints``, ours / peer under
    ``ratios`` and per round under ``round_ratios``, the phases under ``phases``."""

    if config.model is None:
        raise ValueError("bench_side_by_side needs config.model (bench_serve resolves it)")
    generators = {OURS: LoadGenerator(replace(config, peers=()), config.model, count_tokens)}
    for peer in config.peers:
        peer_config = replace(
            config,
            base_url=peer.base_url,
            model=peer.model,
            api_key=None,
            disconnect_share=0.0,
            malformed_share=0.0,
            check_server=False,
            peers=(),
            extra_body=peer.extra_body,
        )
        generators[peer.name] = LoadGenerator(peer_config, peer.model or "", count_tokens)
    on_done = None
    if progress is not None:
        total = len(requests) if config.duration_s is None else None
        tasks = {
            n: progress.add_task(f"serve {n} {g.config.base_url}", total=total) for n, g in generators.items()
        }
        on_done = lambda name: progress.advance(tasks[name])  # noqa: E731
    results, seconds, phases = asyncio.run(run_interleaved(generators, requests, config, on_done))
    endpoints = {n: endpoint_aggregates(results[n], seconds[n], config) for n in generators}
    for name, generator in generators.items():
        endpoints[name]["kv_usage"] = generator.kv_usage
    ours = endpoints[OURS]
    if config.check_server:
        ours["server_after"] = server_state(config.base_url)
    peers = [p.name for p in config.peers]
    aggregates = {
        **ours,
        "endpoints": endpoints,
        "ratios": {p: compute_ratios(ours, endpoints[p]) for p in peers},
        "round_ratios": {p: round_ratios(phases, p) for p in peers},
        "phases": phases,
    }
    records = []
    for name in generators:
        records += [asdict(r) if config.detailed else {**asdict(r), "itl": None} for r in results[name]]
    notes = side_by_side_notes(config, aggregates)
    notes += token_source_notes(endpoints)
    notes += prefix_cache_notes(endpoints)
    notes += [f"peer {name} skipped: unreachable ({why})" for name, why in (skipped or {}).items()]
    endpoint_rows = [{"name": OURS, "base_url": config.base_url, "model": config.model}]
    endpoint_rows += [{"name": p.name, "base_url": p.base_url, "model": p.model} for p in config.peers]
    return BenchRun(
        kind="serve",
        command=command,
        config={
            **asdict(config),
            "workload": describe(list(requests)),
            "endpoints": endpoint_rows,
            "skipped_peers": dict(skipped or {}),
        },
        records=records,
        aggregates=aggregates,
        tables=[side_by_side_table(aggregates, config), phases_table(phases)],
        notes=notes,
        machine=machine_info(),
    )


def side_by_side_notes(config: ServeBenchConfig, aggregates: dict[str, Any]) -> list[str]:
    names = [OURS, *(p.name for p in config.peers)]
    order = " | ".join(
        " ".join(n for r2, n in phase_schedule(names, config.rounds) if r2 == r) for r in range(config.rounds)
    )
    if config.duration_s is not None:
        split = f"each phase sends for {config.duration_s / config.rounds:g} s, then waits for its requests"
    else:
        split = "the requests are split into blocks, block r goes to every endpoint in round r"
    notes = [
        f"side by side, interleaved: {config.rounds} phases per endpoint in the order {order}; {split}; "
        "an endpoint's duration and throughputs are over its own phases",
        "ratios are mcp2026 / peer: above 1 is better for throughputs and goodput, below 1 for latencies",
    ]
    for peer, values in aggregates["round_ratios"].items():
        shown = ", ".join("—" if v is None else f"{v:.2f}x" for v in values)
        notes.append(f"output tok/s ratio vs {peer} per round: {shown}")
    ours_only = [
        name
        for name, on in (
            ("disconnecting clients", config.disconnect_share),
            ("malformed requests", config.malformed_share),
            ("--check-server", config.check_server),
        )
        if on
    ]
    if ours_only:
        notes.append(
            f"{', '.join(ours_only)}: ours only (peers get the normal requests of the same sequence), so the "
            "ratios are not like for like"
        )
    if aggregates.get("num_5xx") or config.disconnect_share or config.malformed_share:
        notes.append(
            f"robustness (ours): {aggregates['num_5xx']} server errors (5xx) over {aggregates['num_sent']} "
            f"requests; statuses by kind {aggregates['statuses']}"
        )
    return notes


def _fmt_ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}x"


def side_by_side_table(aggregates: dict[str, Any], config: ServeBenchConfig) -> Any:
    """A row per metric: each endpoint's value, and ours / peer after each peer."""

    endpoints = aggregates["endpoints"]
    peers = [p.name for p in config.peers]
    columns = ["metric", OURS]
    for p in peers:
        columns += [p, f"{OURS} / {p}"]
    metrics = [
        ("successful requests", "completed", False),
        ("failed requests", "failed", False),
        ("duration (s)", "duration_s", False),
        ("request throughput (req/s)", "request_throughput", True),
        ("output token throughput (tok/s)", "output_throughput", True),
        ("total token throughput (tok/s)", "total_token_throughput", True),
    ]
    if config.goodput_ms:
        slos = ", ".join(f"{k} <= {v:g} ms" for k, v in config.goodput_ms.items())
        metrics.append((f"request goodput (req/s; {slos})", "request_goodput", True))
    for name, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2el", "E2E")):
        metrics.append((f"{label} median (ms)", f"median_{name}_ms", True))
        metrics += [
            (f"{label} p{p:g} (ms)", f"p{p:g}_{name}_ms", True) for p in config.percentiles if p != 50
        ]
    rows = []
    for label, key, with_ratio in metrics:
        row: list[Any] = [label, endpoints[OURS].get(key)]
        for p in peers:
            ratio = aggregates["ratios"][p].get(key) if with_ratio else None
            row += [endpoints[p].get(key), _fmt_ratio(ratio) if with_ratio else "—"]
        rows.append(row)
    return Table("serving side by side (vLLM bench-serve definitions)", columns, rows)


def phases_table(phases: Sequence[dict[str, Any]]) -> Any:
    rows = [
        [
            p["phase"],
            p["round"],
            p["endpoint"],
            p["num_sent"],
            p["completed"],
            p["seconds"],
            p["output_throughput"],
        ]
        for p in phases
    ]
    columns = ["phase", "round", "endpoint", "sent", "completed", "seconds", "output tok/s"]
    return Table("phases (in the order they ran)", columns, rows)
