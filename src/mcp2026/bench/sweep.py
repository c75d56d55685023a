"""``mcp2026 bench sweep``: serve each configuration of a grid in-process (our server on a free loopback
port), drive it with the load generator at each request rate, and mark the Pareto-optimal rows:
throughput vs latency, and quality (perplexity) vs latency.

Per configuration the model loads once; its perplexity (optional) is measured before serving, through the
real paged path (quantized weights, KV codec, eviction), on held-out ShareGPT windows scored as llama.cpp
does (second halves). Each rate gets its own prompt sample (seed + rate index), so the prefix cache cannot
serve a later rate from an earlier one; every configuration sees the same samples.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import socket
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
import torch

from mcp2026.bench.bitplan import model_layer_bits
from mcp2026.bench.offline import check_fits
from mcp2026.bench.pareto import pareto_front
from mcp2026.bench.report import BenchRun, Table, machine_info
from mcp2026.bench.serve import bench_serve
from mcp2026.bench.serve_config import ServeBenchConfig
from mcp2026.bench.sweep_grid import SweepPoint
from mcp2026.bench.workloads import WorkloadSpec, load_workload
from mcp2026.engine.async_engine import AsyncEngine
from mcp2026.quant.perplexity import evaluation_windows
from mcp2026.serve.server import load_pipeline, make_server, pick_gate

if TYPE_CHECKING:
    from mcp2026.engine.compute_thread import ComputeThread

LATENCY_METRICS = tuple(
    f"{stat}_{name}_ms"
    for stat in ("mean", "median", "p90", "p99")
    for name in ("ttft", "tpot", "itl", "e2el")
)
ROW_METRICS = (
    "completed",
    "failed",
    "duration_s",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "request_goodput",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "median_e2el_ms",
    "p99_e2el_ms",
)


@dataclass(frozen=True)
class SweepConfig:
    """The load each configuration gets. The defaults (3 rates x 16 random prompts, 128 tokens in, 32 out,
    2 perplexity windows) are sized to keep one configuration of the embedded model to a couple of minutes
    on 2 cores."""

    rates: tuple[float, ...] = (1.0, 2.0, 4.0)  # requests/s (inf: all at once)
    workload: str = "random"
    burstiness: float = 1.0  # Gamma shape of the arrivals: 1 = Poisson, < 1 burstier (bursty: 0.5)
    num_prompts: int = 16
    input_len: int = 128
    output_len: int = 32
    seed: int = 0
    max_concurrency: int | None = None
    goodput_ms: Mapping[str, float] = field(default_factory=dict)  # SLOs, e.g. {"ttft": 1000}
    quality_windows: int = 2  # held-out windows for perplexity; 0: no quality figure
    quality_ctx: int = 512  # tokens per window (capped at the model's context)
    latency_metric: str = "median_e2el_ms"  # the latency axis of both fronts
    kv_sample_s: float = 0.1  # KV usage sampling interval while serving

    def __post_init__(self) -> None:
        if not self.rates or any(not r > 0 for r in self.rates):
            raise ValueError(f"rates must be > 0 requests/s (inf: all at once), got {self.rates}")
        if self.num_prompts < 1 or self.input_len < 1 or self.output_len < 1:
            raise ValueError("num_prompts, input_len and output_len must be >= 1")
        if self.quality_windows < 0 or self.quality_ctx < 16:
            raise ValueError("quality_windows must be >= 0 and quality_ctx >= 16")
        if self.latency_metric not in LATENCY_METRICS:
            raise ValueError(
                f"latency_metric must be one of {', '.join(LATENCY_METRICS)}, got {self.latency_metric!r}"
            )
        if not self.kv_sample_s > 0:
            raise ValueError(f"kv_sample_s must be > 0, got {self.kv_sample_s}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")


# ---- pieces ---------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(
    pipe: Any, serve: Any, ready_timeout_s: float = 300.0, compute_thread: ComputeThread | None = None
) -> Iterator[tuple[str, str]]:
    """Our HTTP server over ``pipe`` in a thread on a free loopback port; yields (base URL, model id).
    TLS and API keys are dropped: the sweep measures the engine configuration, not the access layer.
    ``compute_thread``: the ComputeThread ``pipe`` was loaded on, which then runs its steps (as a server's)."""

    serve = dataclasses.replace(
        serve,
        host="127.0.0.1",
        port=_free_port(),
        ssl_certfile=None,
        ssl_keyfile=None,
        tenants_file=None,
        model_name=serve.model_name or "sweep",
    )
    async_engine = AsyncEngine(pipe.engine, warmup=serve.warmup, compute_thread=compute_thread)
    gate = pick_gate(serve.traffic.gate, pipe, serve.traffic.pressure_kv_sparsity)
    server = make_server(async_engine, pipe.tokenizer, serve, log_level="warning", gate=gate)
    thread = threading.Thread(target=server.run, name="sweep-server", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{serve.port}"
    deadline = time.monotonic() + ready_timeout_s
    try:
        while True:
            try:
                if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the sweep's server on {url} did not become ready")
            time.sleep(0.05)
        yield url, serve.model_name
    finally:
        server.should_exit = True
        thread.join(60)


@contextmanager
def kv_timeline(engine: Any, interval_s: float) -> Iterator[dict[str, Any]]:
    """KV blocks held by requests, sampled every ``interval_s`` from a thread while the block runs, and the
    peak that the engine saw after its steps (``peak_blocks``: short requests can start and finish between
    two samples)."""
    pool = engine.kv_manager.pool
    timeline: dict[str, Any] = {"t_s": [], "blocks_used": [], "num_blocks": pool.num_online_blocks}
    engine.stats.peak_kv_usage = 0.0  # a running max the loop thread raises after each step
    stop = threading.Event()
    start = time.perf_counter()

    def sample() -> None:
        while True:
            timeline["t_s"].append(round(time.perf_counter() - start, 4))
            timeline["blocks_used"].append(pool.num_used_blocks)
            if stop.wait(interval_s):
                return

    thread = threading.Thread(target=sample, name="sweep-kv-sampler", daemon=True)
    thread.start()
    try:
        yield timeline
    finally:
        stop.set()
        thread.join()
        stepped = round(engine.stats.peak_kv_usage * pool.num_online_blocks)
        timeline["peak_blocks"] = max(stepped, *timeline["blocks_used"])


def paged_perplexity(
    engine: Any, windows: Sequence[Sequence[int]], chunk_size: int = 16
) -> tuple[float, int]:
    """(perplexity, tokens scored) of the second half of each window, teacher-forced through the engine's
    paged cache: the first half as one prefill, then ``chunk_size``-token chunks that read the cached
    (possibly compressed or evicted) KV. The engine must be idle."""

    if not windows:
        raise ValueError("no perplexity windows (too little held-out text?)")
    nll, count = 0.0, 0
    for window in windows:
        tokens = [int(t) for t in window]
        first = len(tokens) // 2
        if first < 1:
            raise ValueError(f"a perplexity window needs at least 2 tokens, got {len(tokens)}")
        chunks = engine.score(tokens, first, first, chunk_size, request_id="sweep-ppl")
        for start, logits in chunks:
            lo, hi = max(start, first), min(start + logits.shape[0], len(tokens) - 1)
            if lo >= hi:
                continue
            logprobs = torch.log_softmax(logits[lo - start : hi - start].double(), dim=-1)
            targets = torch.tensor(tokens[lo + 1 : hi + 1]).unsqueeze(1)
            nll -= float(logprobs.gather(1, targets).sum())
            count += hi - lo
    return math.exp(nll / count), count


def held_out_windows(pipe: Any, config: SweepConfig) -> list[list[int]]:
    """Held-out ShareGPT windows for this model's tokenizer (ValueError without a tokenizer)."""

    if pipe.tokenizer is None:
        raise ValueError("the model has no tokenizer to cut held-out text into windows")
    n_ctx = min(config.quality_ctx, pipe.engine.max_model_len)
    windows = evaluation_windows(pipe.tokenizer, config.quality_windows, n_ctx, config.seed)
    return [w.tolist() for w in windows]


def _requests(config: SweepConfig, pipe: Any, rate_index: int) -> list[Any]:
    spec = WorkloadSpec(
        config.workload, config.num_prompts, config.seed + rate_index, config.input_len, config.output_len
    )
    requests = load_workload(spec, pipe.tokenizer, pipe.loaded.config.vocab_size)
    check_fits(requests, pipe.engine.max_model_len)
    return requests


# ---- the sweep ------------------------------------------------------------------------------------
def _serve_rates(
    point: SweepPoint,
    pipe: Any,
    config: SweepConfig,
    progress: Any,
    task: Any,
    notes: list[str],
    compute_thread: ComputeThread | None = None,
) -> list[dict[str, Any]]:
    rows = []
    with running_server(pipe, point.serve, compute_thread=compute_thread) as (url, model_id):
        for i, rate in enumerate(config.rates):
            load = ServeBenchConfig(
                base_url=url,
                model=model_id,
                request_rate=rate,
                burstiness=config.burstiness,
                max_concurrency=config.max_concurrency,
                seed=config.seed + i,
                goodput_ms=dict(config.goodput_ms),
                check_server=True,
                kv_sample_s=None,  # kv_timeline reads the engine itself, step-exact
            )
            requests = _requests(config, pipe, i)
            if progress is not None:
                progress.update(task, description=f"sweep: {point.name} @ {rate:g} req/s")
            with kv_timeline(pipe.engine, config.kv_sample_s) as timeline:
                run = bench_serve(load, requests, progress)
            agg = run.aggregates
            if not agg["server_after"]["idle"]:
                notes.append(f"{point.name} @ {rate:g}/s: the server did not go idle ({agg['server_after']})")
            row = {"config": point.name, "rate": rate, **{k: agg[k] for k in ROW_METRICS}}
            row[config.latency_metric] = agg[config.latency_metric]
            row["kv_peak_blocks"] = timeline["peak_blocks"]
            row["requests"] = [  # per request, for latency CDFs
                {"ttft": r["ttft"], "latency": r["latency"], "output_tokens": r["output_tokens"]}
                for r in run.records
                if r["kind"] == "normal" and r["success"]
            ]
            row["kv_timeline"] = timeline
            rows.append(row)
            if progress is not None:
                for extra in [t for t in progress.task_ids if t != task]:
                    progress.remove_task(extra)  # bench_serve's per-rate bar
                progress.advance(task)
    return rows


def _mark_fronts(rows: list[dict[str, Any]], metric: str) -> None:
    """Rows where every request completed compete; the others are on no front."""
    usable = [r for r in rows if r["completed"] and not r["failed"]]
    throughput = set(pareto_front(usable, minimize=[metric], maximize=["output_throughput"]))
    quality = set(pareto_front(usable, minimize=[metric, "ppl"]))
    for row in rows:
        row["throughput_front"] = row["quality_front"] = False
    for i, row in enumerate(usable):
        row["throughput_front"], row["quality_front"] = i in throughput, i in quality


def _tables(rows: list[dict[str, Any]], configs: dict[str, Any], config: SweepConfig) -> list[Table]:
    metric = config.latency_metric
    columns = ["config", "rate (req/s)", "done", "out tok/s", "TTFT p50/p99 (ms)", "TPOT p50/p99 (ms)",
               "E2E p50/p99 (ms)", metric, "PPL", "KV peak blocks", "front"]  # fmt: skip
    if config.goodput_ms:
        columns.insert(4, "goodput (req/s)")
    body = []
    for r in rows:
        front = " ".join(mark for mark, key in (("T", "throughput_front"), ("Q", "quality_front")) if r[key])
        cells = [
            r["config"], r["rate"], f"{r['completed']}/{r['completed'] + r['failed']}", r["output_throughput"],
            f"{r['median_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f}", f"{r['median_tpot_ms']:.1f} / {r['p99_tpot_ms']:.1f}",
            f"{r['median_e2el_ms']:.0f} / {r['p99_e2el_ms']:.0f}", r[metric], r["ppl"], r["kv_peak_blocks"], front,
        ]  # fmt: skip
        if config.goodput_ms:
            cells.insert(4, r["request_goodput"])
        body.append(cells)
    rows_table = Table(
        f"Sweep: {len(configs)} configs x {len(config.rates)} rates, {config.num_prompts} {config.workload} "
        f"prompts each ({config.input_len} in / {config.output_len} out for random); front: T = throughput vs "
        f"{metric}, Q = PPL vs {metric}",
        columns,
        body,
    )
    config_rows = [
        [name, c["serve"]["model"] or "(embedded)", c["serve"]["dtype"], c["serve"]["quant"] or "—",
         (c["kv_compressor"] or {}).get("dtype", "—"), (c["kv_compressor"] or {}).get("policy", "—"),
         c["scheduler"]["max_num_seqs"], c["scheduler"]["max_num_batched_tokens"], c["ppl"], c["ppl_tokens"],
         c["load_s"]]
        for name, c in configs.items()
    ]  # fmt: skip
    config_columns = ["config", "model", "dtype", "quant", "KV codec", "KV policy", "max_num_seqs",
                      "max_num_batched_tokens", "PPL", "PPL tokens", "load s"]  # fmt: skip
    return [rows_table, Table("Sweep configurations", config_columns, config_rows)]


def run_sweep(
    config: SweepConfig,
    points: Sequence[SweepPoint],
    progress: Any = None,
    windows: Sequence[Sequence[int]] | None = None,
    command: str = "",
) -> BenchRun:
    """Serve every point at every rate; one row per (point, rate). ``windows``: token windows for the
    perplexity figure instead of held-out ShareGPT text (tests, models without a tokenizer)."""

    if not points:
        raise ValueError("the sweep grid is empty: give --configs or grid options")
    names = [p.name for p in points]
    if len(set(names)) < len(names):
        raise ValueError(f"sweep configurations need distinct names, got {names}")
    notes: list[str] = []
    rows: list[dict[str, Any]] = []
    configs: dict[str, Any] = {}
    layer_bits: dict[str, dict[str, float]] = {}
    task = progress.add_task("sweep", total=len(points) * len(config.rates)) if progress is not None else None
    for point in points:
        t0 = time.perf_counter()
        pipe, compute = load_pipeline(point.serve, point.engine)  # as `mcp2026 serve` loads and steps it
        try:
            info = {**point.describe(), "load_s": time.perf_counter() - t0, "ppl": None, "ppl_tokens": None}
            if windows is not None or config.quality_windows:
                try:
                    chosen = windows if windows is not None else held_out_windows(pipe, config)
                    info["ppl"], info["ppl_tokens"] = compute.run(paged_perplexity, pipe.engine, chosen)
                except (ValueError, FileNotFoundError) as e:
                    notes.append(f"{point.name}: no perplexity ({e})")
            if point.serve.quant:
                layer_bits[point.name] = model_layer_bits(pipe.loaded.model)
            configs[point.name] = info
            point_rows = _serve_rates(point, pipe, config, progress, task, notes, compute)
        finally:
            compute.stop()  # the thread ends; the next point loads on a new one
        for row in point_rows:
            row["ppl"] = info["ppl"]
        rows += point_rows
        del pipe
        gc.collect()
    _mark_fronts(rows, config.latency_metric)
    notes.append(
        "each rate gets its own prompt sample (seed + rate index), the same for every configuration; fronts "
        f"compare rows where every request completed, on {config.latency_metric}"
    )
    return BenchRun(
        kind="sweep",
        command=command or "mcp2026.bench.sweep.run_sweep (Python API; settings in config)",
        config={**dataclasses.asdict(config), "points": names},
        records=rows,
        aggregates={
            "configs": configs,
            "layer_bits": layer_bits,
            "throughput_front": [f"{r['config']} @{r['rate']:g}" for r in rows if r["throughput_front"]],
            "quality_front": [f"{r['config']} @{r['rate']:g}" for r in rows if r["quality_front"]],
        },
        tables=_tables(rows, configs, config),
        notes=notes,
        machine=machine_info(),
    )
