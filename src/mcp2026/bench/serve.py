"""Serving load generator: streaming requests against any OpenAI-compatible ``/v1/completions`` endpoint
(ours, llama.cpp's server, vLLM) with the metric definitions of vLLM's ``bench serve``
(vllm/benchmarks/serve.py), so numbers are comparable across engines.

Arrivals: Gamma intervals with shape ``burstiness`` and mean ``1 / request_rate`` (burstiness 1 = Poisson;
rate inf = all at once), capped by ``max_concurrency``. Prompts go as token ids, so every engine gets the same
tokens. Per request: TTFT, ITL, TPOT, E2E; aggregates: throughputs, mean/median/std/percentiles, goodput.
Optionally a share of clients disconnect mid-stream and a share of requests are malformed (robustness runs).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from mcp2026.bench.workloads import BenchRequest

GOODPUT_METRICS = ("ttft", "tpot", "e2el")
METRICS_MS = ("ttft", "tpot", "itl", "e2el")


@dataclass(frozen=True)
class ServeBenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None  # None: the first id of GET /v1/models
    api_key: str | None = None
    request_rate: float = math.inf  # requests/s; inf sends everything at once
    burstiness: float = 1.0  # Gamma shape: 1 = Poisson, < 1 burstier, > 1 more regular
    max_concurrency: int | None = None
    seed: int = 0
    duration_s: float | None = None  # cycle the requests until then (None: each request once)
    max_requests: int = 100_000  # hard cap on requests issued in duration mode
    goodput_ms: dict[str, float] = field(default_factory=dict)  # SLOs, e.g. {"ttft": 1000, "tpot": 100}
    percentiles: tuple[float, ...] = (50.0, 90.0, 99.0)
    disconnect_share: float = 0.0  # clients that close the stream after a few chunks
    malformed_share: float = 0.0  # requests replaced by broken bodies (they must get a 4xx)
    ignore_eos: bool = True  # every engine generates exactly output_len tokens
    timeout_s: float = 600.0
    check_server: bool = False  # afterwards read our server's /metrics: nothing running, no KV held
    detailed: bool = False  # keep every request's ITLs in the records

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (inf = all at once), got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s}")
        unknown = sorted(set(self.goodput_ms) - set(GOODPUT_METRICS))
        if unknown or any(not v > 0 for v in self.goodput_ms.values()):
            raise ValueError(
                f"goodput takes {GOODPUT_METRICS} with positive milliseconds, got {self.goodput_ms}"
            )
        for name in ("disconnect_share", "malformed_share"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {self.base_url!r}")


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """``["ttft:1000", "tpot:100"]`` -> ``{"ttft": 1000.0, "tpot": 100.0}`` (vLLM's --goodput syntax)."""
    slos = {}
    for item in items:
        name, _, value = item.partition(":")
        if name not in GOODPUT_METRICS or not value:
            raise ValueError(f"--goodput takes NAME:MS with NAME in {GOODPUT_METRICS}, got {item!r}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
    return slos


@dataclass
class RequestResult:
    """One request as the client saw it. Times in seconds; ``ttft``/``latency`` from the send."""

    request_id: str
    kind: str  # "normal" | "disconnect" | "malformed"
    prompt_len: int
    success: bool = False
    status: int | None = None  # HTTP status (None: no response)
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    start_time: float = 0.0  # since the benchmark start
    error: str = ""


# ---- metric math (pure) -------------------------------------------------------------------------
def compute_metrics(
    results: Sequence[RequestResult],
    duration_s: float,
    goodput_ms: dict[str, float] | None = None,
    percentiles: Sequence[float] = (50.0, 90.0, 99.0),
) -> dict[str, Any]:
    """vLLM's ``calculate_metrics`` over the normal requests: TPOT = (latency - TTFT) / (output tokens - 1)
    for requests with more than one token; for goodput a one-token request's TPOT counts as 0."""
    normal = [r for r in results if r.kind == "normal"]
    done = [r for r in normal if r.success]
    ttfts = [r.ttft for r in done]
    e2els = [r.latency for r in done]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    all_tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0 for r in done]
    itls = [x for r in done for x in r.itl]
    num_input = sum(r.prompt_len for r in done)
    num_output = sum(r.output_tokens for r in done)
    good = _num_good(ttfts, all_tpots, e2els, goodput_ms or {})
    out: dict[str, Any] = {
        "duration_s": duration_s,
        "completed": len(done),
        "failed": len(normal) - len(done),
        "total_input_tokens": num_input,
        "total_output_tokens": num_output,
        "request_throughput": len(done) / duration_s,
        "request_goodput": good / duration_s if goodput_ms else None,
        "output_throughput": num_output / duration_s,
        "total_token_throughput": (num_input + num_output) / duration_s,
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        ms = np.asarray(values, dtype=float) * 1e3
        out[f"mean_{name}_ms"] = float(ms.mean()) if ms.size else 0.0
        out[f"median_{name}_ms"] = float(np.median(ms)) if ms.size else 0.0
        out[f"std_{name}_ms"] = float(ms.std()) if ms.size else 0.0
        for p in percentiles:
            out[f"p{p:g}_{name}_ms"] = float(np.percentile(ms, p)) if ms.size else 0.0
    return out


def _num_good(ttfts: list[float], tpots: list[float], e2els: list[float], slos_ms: dict[str, float]) -> int:
    if not slos_ms:
        return 0
    series = {"ttft": ttfts, "tpot": tpots, "e2el": e2els}
    names = [n for n in GOODPUT_METRICS if n in slos_ms]
    return sum(
        all(value <= slos_ms[n] / 1e3 for n, value in zip(names, row))
        for row in zip(*(series[n] for n in names))
    )


def robustness_summary(results: Sequence[RequestResult]) -> dict[str, Any]:
    """HTTP statuses by request kind and the 5xx count (a robust server has none)."""
    statuses = {
        kind: dict(Counter(str(r.status) for r in results if r.kind == kind))
        for kind in ("normal", "disconnect", "malformed")
    }
    num_5xx = sum(1 for r in results if (r.status or 0) >= 500 or "server_error" in r.error)
    return {
        "statuses": statuses,
        "num_5xx": num_5xx,
        "num_no_response": sum(r.status is None for r in results),
    }


# ---- the client ---------------------------------------------------------------------------------
MALFORMED: list[Callable[[str], Any]] = [
    lambda model: b'{"model": "' + model.encode() + b'", "prompt": [1, 2',  # truncated JSON
    lambda model: {"model": model},  # no prompt
    lambda model: {"model": model, "prompt": [1, 2, 3], "max_tokens": -5},
    lambda model: {"model": model, "prompt": [1, 2, 3], "temperature": "hot"},
    lambda model: {"model": model, "prompt": []},
    lambda model: {"model": model + "-missing", "prompt": [1, 2, 3]},
    lambda model: {"model": model, "prompt": [1, 2, 3], "n": 0},
    lambda model: {"model": model, "prompt": [1 << 30]},  # not a token of any vocabulary
]


@dataclass
class _Plan:
    request: BenchRequest
    kind: str
    disconnect_after: int  # chunks received before a "disconnect" client leaves
    malformed: int  # index into MALFORMED


class LoadGenerator:
    def __init__(self, config: ServeBenchConfig, model: str) -> None:
        self.config = config
        self.model = model
        self.headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}

    def plan_at(self, requests: Sequence[BenchRequest], i: int) -> _Plan:
        """What request ``i`` sends (the workload cycled in duration mode), drawn from a seed per index."""
        rng = random.Random(self.config.seed * 1_000_003 + i)
        request = requests[i % len(requests)]
        if i >= len(requests):
            request = BenchRequest(f"{request.request_id}-r{i}", request.prompt_token_ids, request.output_len)
        kind = "malformed" if rng.random() < self.config.malformed_share else "normal"
        if kind == "normal" and rng.random() < self.config.disconnect_share:
            kind = "disconnect"
        after = rng.randint(1, max(1, request.output_len // 2))
        return _Plan(request, kind, after, rng.randrange(len(MALFORMED)))

    async def send(self, client: Any, plan: _Plan, t0: float) -> RequestResult:
        request = plan.request
        result = RequestResult(
            request.request_id, plan.kind, request.prompt_len, start_time=time.perf_counter() - t0
        )
        try:
            if plan.kind == "malformed":
                await self._send_malformed(client, plan, result)
            else:
                await self._stream(client, plan, result)
        except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash of the run
            result.success, result.error = False, f"{type(e).__name__}: {e}"
        return result

    async def _send_malformed(self, client: Any, plan: _Plan, result: RequestResult) -> None:
        body = MALFORMED[plan.malformed](self.model)
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {**self.headers, "Content-Type": "application/json"}
        response = await client.post("/v1/completions", content=content, headers=headers)
        result.status = response.status_code
        result.success = 400 <= response.status_code < 500

    async def _stream(self, client: Any, plan: _Plan, result: RequestResult) -> None:
        request = plan.request
        body = {
            "model": self.model,
            "prompt": request.prompt_token_ids,
            "max_tokens": request.output_len,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": self.config.ignore_eos,
        }
        st = time.perf_counter()
        last, num_chunks, usage_tokens = st, 0, None
        async with client.stream("POST", "/v1/completions", json=body, headers=self.headers) as response:
            result.status = response.status_code
            if response.status_code != 200:
                result.error = (await response.aread()).decode("utf-8", "replace")[:500]
                return
            async for line in response.aiter_lines():
                data = line.removeprefix("data:").strip() if line.startswith("data:") else ""
                if not data or data == "[DONE]":
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = json.dumps(chunk["error"])[:500]
                    return
                now = time.perf_counter()
                if chunk.get("choices"):
                    if num_chunks == 0:
                        result.ttft = now - st
                    else:
                        result.itl.append(now - last)
                    last, num_chunks = now, num_chunks + 1
                    if plan.kind == "disconnect" and num_chunks >= plan.disconnect_after:
                        return  # leaving the block closes the connection mid-stream
                elif chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
        result.latency = last - st
        result.output_tokens = usage_tokens if usage_tokens is not None else num_chunks
        result.success = num_chunks > 0

    async def run(
        self, requests: Sequence[BenchRequest], on_done: Callable[[], None] | None = None
    ) -> tuple[list[RequestResult], float]:
        """Send every request once (or cycle them for ``duration_s``); returns results and the wall time."""
        import httpx

        config = self.config
        if not requests:
            raise ValueError("no requests to send")
        num = len(requests) if config.duration_s is None else config.max_requests
        rng = np.random.RandomState(config.seed)
        theta = 1.0 / (config.request_rate * config.burstiness)
        limit = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
        max_pending = (config.max_concurrency or 256) * 4  # duration mode: tasks waiting for a slot
        limits = httpx.Limits(
            max_connections=config.max_concurrency, max_keepalive_connections=config.max_concurrency
        )
        timeout = httpx.Timeout(config.timeout_s, connect=30.0)
        results: list[RequestResult] = []
        pending: set[asyncio.Task] = set()
        async with httpx.AsyncClient(base_url=config.base_url, timeout=timeout, limits=limits) as client:

            async def one(plan: _Plan) -> None:
                if limit is None:
                    results.append(await self.send(client, plan, t0))
                else:
                    async with limit:
                        results.append(await self.send(client, plan, t0))
                if on_done is not None:
                    on_done()

            t0 = time.perf_counter()
            for i in range(num):
                if config.duration_s is not None and time.perf_counter() - t0 >= config.duration_s:
                    break
                task = asyncio.create_task(one(self.plan_at(requests, i)))
                pending.add(task)
                task.add_done_callback(pending.discard)
                while len(pending) >= max_pending:
                    await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if not math.isinf(config.request_rate):
                    await asyncio.sleep(rng.gamma(shape=config.burstiness, scale=theta))
            if pending:
                await asyncio.gather(*pending)
        results.sort(key=lambda r: r.start_time)
        return results, time.perf_counter() - t0


# ---- the run ------------------------------------------------------------------------------------
def discover_model(config: ServeBenchConfig) -> str:
    """The first model id the endpoint lists."""
    import httpx

    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    response = httpx.get(f"{config.base_url}/v1/models", headers=headers, timeout=30)
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise ValueError(f"{config.base_url}/v1/models lists no model; pass the model name")
    return models[0]["id"]


def server_state(base_url: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """Our server's engine after a run, from /metrics: waits up to ``timeout_s`` for it to go idle (no
    request running or waiting, no KV block held). ``idle`` False means something leaked or hangs."""
    import httpx

    names = {
        "mcp2026_num_requests_running": "num_running",
        "mcp2026_num_requests_waiting": "num_waiting",
        "mcp2026_kv_cache_usage_ratio": "kv_usage",
    }
    deadline = time.monotonic() + timeout_s
    state: dict[str, Any] = {}
    while True:
        text = httpx.get(f"{base_url}/metrics", timeout=10).text
        for line in text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in names:
                state[names[name]] = float(line.rsplit(" ", 1)[1])
        state["idle"] = len(state) == len(names) and not any(state[k] for k in names.values())
        if state["idle"] or time.monotonic() > deadline:
            return state
        time.sleep(0.1)


def summary_table(metrics: dict[str, Any], config: ServeBenchConfig) -> Any:
    from mcp2026.bench.report import Table

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
) -> Any:
    """Run the load against ``config.base_url`` and return a ``BenchRun`` (kind "serve"): per-request
    records, vLLM-style aggregates, the 5xx count and (``check_server``) the server's state afterwards.
    ``progress``: a rich Progress (or None)."""
    from mcp2026.bench.report import BenchRun, machine_info
    from mcp2026.bench.workloads import describe

    model = config.model or discover_model(config)
    total = len(requests) if config.duration_s is None else None
    task = progress.add_task(f"serve {config.base_url}", total=total) if progress is not None else None
    on_done = (lambda: progress.advance(task)) if progress is not None else None
    results, duration_s = asyncio.run(LoadGenerator(config, model).run(requests, on_done))
    aggregates = compute_metrics(results, duration_s, config.goodput_ms, config.percentiles)
    aggregates.update(robustness_summary(results))
    aggregates["num_sent"] = len(results)
    if config.check_server:
        aggregates["server_after"] = server_state(config.base_url)
    records = [asdict(r) if config.detailed else {**asdict(r), "itl": None} for r in results]
    notes = []
    if config.disconnect_share or config.malformed_share:
        notes.append(
            f"robustness: {aggregates['num_5xx']} server errors (5xx) over {len(results)} requests; "
            f"statuses by kind {aggregates['statuses']}"
        )
    return BenchRun(
        kind="serve",
        command=command,
        config={**asdict(config), "model": model, "workload": describe(list(requests))},
        records=records,
        aggregates=aggregates,
        tables=[summary_table(aggregates, config)],
        notes=notes,
        machine=machine_info(),
    )
