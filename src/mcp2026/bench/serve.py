"""Serving load generator: streaming requests against any OpenAI-compatible ``/v1/completions`` endpoint
(ours, llama.cpp's server, vLLM) with the metric definitions of vLLM's ``bench serve``
(vllm/benchmarks/serve.py), so numbers are comparable across engines.

Arrivals as vLLM schedules them: request ``i`` is sent at a fixed offset from the start, the sum of ``i + 1``
Gamma gaps with shape ``burstiness`` and mean ``1 / request_rate`` (burstiness 1 = Poisson; rate inf = all at
once), rescaled so that a run of N requests sends its last at N / rate; ``max_concurrency`` caps the requests
in flight (a request due while every slot is busy waits for one). Prompts go as token ids, so every engine gets the same
tokens. Per request: TTFT, ITL, TPOT, E2E; aggregates: throughputs, mean/median/std/percentiles, goodput.
Optionally a share of clients disconnect mid-stream and a share of requests are malformed (robustness runs).

Side by side (``peers``): the same workload goes to our server and to each peer in interleaved phases (see
``bench_serve``), and the report gives each endpoint's aggregates and the ratios ours / peer.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from mcp2026.bench.kv_usage import join_phases, prometheus_values
from mcp2026.bench.workloads import BenchRequest

GOODPUT_METRICS = ("ttft", "tpot", "e2el")
METRICS_MS = ("ttft", "tpot", "itl", "e2el")
OURS = "mcp2026"  # our endpoint's name in side-by-side runs
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclass(frozen=True)
class PeerEndpoint:
    """Another OpenAI-compatible server measured side by side with ours (e.g. llama.cpp's llama-server)."""

    name: str
    base_url: str
    model: str | None = None  # None: the first id of its GET /v1/models

    def __post_init__(self) -> None:
        if not _NAME.match(self.name) or self.name == OURS:
            raise ValueError(
                f"a peer's name is letters, digits, '.', '_' and '-' and not {OURS!r}, got {self.name!r}"
            )
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(
                f"peer {self.name}: URL must start with http:// or https://, got {self.base_url!r}"
            )


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
    kv_sample_s: float | None = 0.5  # poll the server's /metrics for its KV usage this often (None: never)
    timeout_s: float = 600.0
    check_server: bool = False  # afterwards read our server's /metrics: nothing running, no KV held
    detailed: bool = False  # keep every request's ITLs in the records
    peers: tuple[PeerEndpoint, ...] = ()  # served the same workload, interleaved with ours
    rounds: int = 2  # side by side: phases per endpoint (every other round in reverse order)

    def __post_init__(self) -> None:
        object.__setattr__(self, "peers", tuple(self.peers))
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")
        names = [p.name for p in self.peers]
        if len(set(names)) != len(names):
            raise ValueError(f"peer names must be unique, got {names}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (inf = all at once), got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.kv_sample_s is not None and not self.kv_sample_s > 0:
            raise ValueError(f"kv_sample_s must be > 0 (None: no sampling), got {self.kv_sample_s}")
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


def parse_peers(urls: Sequence[str], models: Sequence[str] = ()) -> tuple[PeerEndpoint, ...]:
    """``--peer-url NAME=URL`` (repeatable) and ``--peer-model NAME=MODEL`` for some of those peers."""

    def pairs(items: Sequence[str], option: str, what: str) -> dict[str, str]:
        out: dict[str, str] = {}
        for item in items:
            name, sep, value = item.partition("=")
            if not sep or not name or not value:
                raise ValueError(f"{option} takes NAME={what}, got {item!r}")
            if name in out:
                raise ValueError(f"{option}: {name!r} given twice")
            out[name] = value
        return out

    by_url = pairs(urls, "--peer-url", "URL")
    by_model = pairs(models, "--peer-model", "MODEL")
    unknown = sorted(set(by_model) - set(by_url))
    if unknown:
        raise ValueError(f"--peer-model names peers without a --peer-url: {unknown}")
    return tuple(PeerEndpoint(n, u.rstrip("/"), by_model.get(n)) for n, u in by_url.items())


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """``["ttft:1000", "tpot:100"]`` -> ``{"ttft": 1000.0, "tpot": 100.0}`` (vLLM's --goodput syntax); an item
    may hold several, comma- or space-separated (``"ttft:1000,tpot:100"``)."""
    slos = {}
    for item in (part for text in items for part in re.split(r"[,\s]+", text.strip()) if part):
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
    token_source: str = ""  # where output_tokens came from: "usage" | "tokenizer" | "chunks"
    cached_tokens: int | None = None  # prompt tokens served from the server's prefix cache, as its usage says
    endpoint: str = ""  # side-by-side runs: which endpoint served it
    phase: int = 0  # side-by-side runs: the phase it was sent in
    retries: int = 0  # sent again after the server dropped a keep-alive connection before any response


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


@dataclass
class PhaseResult:
    """One uninterrupted stretch of load against one endpoint: its results, its wall time (from the first
    send until the last response ended) and the index the next phase of this endpoint starts at."""

    results: list[RequestResult]
    seconds: float
    next_index: int
    kv_usage: dict[str, Any] | None = None  # the server's KV pool share over the phase (bench.kv_usage)


class LoadGenerator:
    """Sends the workload to one endpoint. Request ``i`` (its prompt, kind and the gap before the next
    arrival) depends only on the seed and ``i``, so every endpoint gets the same sequence, whether in one
    run or split into phases."""

    def __init__(
        self, config: ServeBenchConfig, model: str, count_tokens: Callable[[str], int] | None = None
    ) -> None:
        self.config = config
        self.model = model
        self.count_tokens = count_tokens  # for responses without usage: tokens of the generated text
        self.headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self._arrivals = np.random.RandomState(config.seed)
        self._sums: list[float] = []  # running sums of the Gamma gaps, request 0's included
        self.kv_usage: dict[str, Any] | None = None  # of the last run()

    def arrival_offset(self, i: int, num_requests: int | None = None) -> float:
        """Seconds from the start of the sequence to request ``i``'s arrival (vLLM's ``delay_ts[i]``): the sum
        of Gamma gaps 0 .. i (seeded; 0 at rate inf, -1 is the start). ``num_requests``: the run sends that
        many, and, as in vLLM, the offsets are scaled so that the last one is due at ``num_requests / rate``
        (the raw sum misses it by a few percent); duration runs are open-ended and not scaled."""
        rate = self.config.request_rate
        if i < 0 or math.isinf(rate):
            return 0.0
        theta = 1.0 / (rate * self.config.burstiness)
        while len(self._sums) <= max(i, (num_requests or 0) - 1):
            gap = float(self._arrivals.gamma(shape=self.config.burstiness, scale=theta))
            self._sums.append(gap + (self._sums[-1] if self._sums else 0.0))
        if not num_requests or self._sums[num_requests - 1] <= 0:
            return self._sums[i]
        return self._sums[i] * (num_requests / rate) / self._sums[num_requests - 1]

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
                await self._stream_once_retried(client, plan, result)
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

    async def _stream_once_retried(self, client: Any, plan: _Plan, result: RequestResult) -> None:
        """``_stream``, sent once more when the server closed the connection before any response: a pooled
        keep-alive connection it had just closed as idle (llama-server does after 5 s), so the request never
        reached it. Counted in ``retries``; anything after a response has started is a failure."""
        import httpx

        try:
            await self._stream(client, plan, result)
        except httpx.RemoteProtocolError:
            if result.status is not None:
                raise
            result.retries += 1
            await self._stream(client, plan, result)

    async def _stream(self, client: Any, plan: _Plan, result: RequestResult) -> None:
        """One streamed completion. A chunk with choices carries tokens, except llama-server's closing
        chunk (after the tokens: empty text, a finish_reason and the usage in one chunk), which moves
        neither TTFT, ITL nor the end time. (Ours ends with the last token's chunk, whose text may be
        empty, and sends the usage in a chunk without choices.) Output tokens: the usage the server
        reports, else our tokenizer over the text, else the number of token chunks."""
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
        text: list[str] = []
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
                usage = chunk.get("usage")
                if isinstance(usage, dict):
                    usage_tokens = usage.get("completion_tokens")
                    details = usage.get("prompt_tokens_details")
                    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                        result.cached_tokens = details["cached_tokens"]
                choices = chunk.get("choices") or []
                if not choices:
                    continue
                piece = choices[0].get("text") or ""
                if num_chunks and usage and not piece and choices[0].get("finish_reason") is not None:
                    continue  # llama-server's closing chunk: no token in it
                text.append(piece)
                if num_chunks == 0:
                    result.ttft = now - st
                else:
                    result.itl.append(now - last)
                last, num_chunks = now, num_chunks + 1
                if plan.kind == "disconnect" and num_chunks >= plan.disconnect_after:
                    return  # leaving the block closes the connection mid-stream
        result.latency = last - st
        if usage_tokens is not None:
            result.output_tokens, result.token_source = int(usage_tokens), "usage"
        elif self.count_tokens is not None:
            result.output_tokens, result.token_source = self.count_tokens("".join(text)), "tokenizer"
        else:
            result.output_tokens, result.token_source = num_chunks, "chunks"
        result.success = num_chunks > 0

    async def run(
        self, requests: Sequence[BenchRequest], on_done: Callable[[], None] | None = None
    ) -> tuple[list[RequestResult], float]:
        """Send every request once (or cycle them for ``duration_s``); returns results and the wall time."""
        config = self.config
        stop = len(requests) if config.duration_s is None else config.max_requests
        phase = await self.run_phase(requests, 0, stop, config.duration_s, on_done)
        self.kv_usage = phase.kv_usage
        return phase.results, phase.seconds

    async def run_phase(
        self,
        requests: Sequence[BenchRequest],
        start: int,
        stop: int,
        duration_s: float | None = None,
        on_done: Callable[[], None] | None = None,
    ) -> PhaseResult:
        """Send requests ``start .. stop - 1``, each at its ``arrival_offset`` counted from the arrival of
        request ``start - 1`` (with ``duration_s``: until that many seconds have passed; a request still
        waiting for a concurrency slot then is not sent, and the next phase starts at the first such one).
        Returns once every sent request has ended."""
        import httpx

        config = self.config
        if not requests:
            raise ValueError("no requests to send")
        limit = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
        max_pending = (config.max_concurrency or 256) * 4  # duration mode: tasks waiting for a slot
        limits = httpx.Limits(
            max_connections=config.max_concurrency, max_keepalive_connections=config.max_concurrency
        )
        timeout = httpx.Timeout(config.timeout_s, connect=30.0)
        results: list[RequestResult] = []
        unsent: list[int] = []
        pending: set[asyncio.Task] = set()
        next_index = start
        async with httpx.AsyncClient(base_url=config.base_url, timeout=timeout, limits=limits) as client:

            async def one(i: int, plan: _Plan) -> None:
                if limit is not None:
                    await limit.acquire()
                try:
                    if duration_s is not None and time.perf_counter() - t0 >= duration_s:
                        unsent.append(i)  # time is up before a slot came free
                        return
                    results.append(await self.send(client, plan, t0))
                finally:
                    if limit is not None:
                        limit.release()
                if on_done is not None:
                    on_done()

            # A fixed-length run (every request once) scales its schedule as vLLM does; duration runs don't.
            num_scheduled = len(requests) if duration_s is None else None
            base = self.arrival_offset(start - 1, num_scheduled)
            t0 = time.perf_counter()
            stop_sampling = asyncio.Event()
            sampler = None
            if config.kv_sample_s:  # its own connection: never one a request is waiting for
                from mcp2026.bench.kv_usage import sample_kv_usage

                sampler = asyncio.create_task(
                    sample_kv_usage(config.base_url, self.headers, config.kv_sample_s, t0, stop_sampling)
                )
            try:
                for i in range(start, stop):
                    # An absolute schedule: time lost to a late wake-up is not added to every later arrival.
                    due = self.arrival_offset(i, num_scheduled) - base
                    if duration_s is not None and due >= duration_s:
                        break  # due after the phase's window: the next phase starts with it
                    wait = due - (time.perf_counter() - t0)
                    if wait > 0:
                        await asyncio.sleep(wait)
                    if duration_s is not None and time.perf_counter() - t0 >= duration_s:
                        break
                    task = asyncio.create_task(one(i, self.plan_at(requests, i)))
                    pending.add(task)
                    task.add_done_callback(pending.discard)
                    next_index = i + 1
                    while len(pending) >= max_pending:
                        await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if pending:
                    await asyncio.gather(*pending)
                seconds = time.perf_counter() - t0
                stop_sampling.set()
                kv_usage = await sampler if sampler is not None else None
            finally:  # an error or a cancellation: nothing of this phase keeps running
                for task in [*pending, *([sampler] if sampler is not None else [])]:
                    task.cancel()
        results.sort(key=lambda r: r.start_time)
        return PhaseResult(results, seconds, min(unsent, default=next_index), kv_usage)


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
        values = prometheus_values(httpx.get(f"{base_url}/metrics", timeout=10).text, names)
        state.update({names[name]: value for name, value in values.items()})
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
    count_tokens: Callable[[str], int] | None = None,
    log: Callable[[str], None] | None = None,
) -> Any:
    """Run the load against ``config.base_url`` and return a ``BenchRun`` (kind "serve"): per-request
    records, vLLM-style aggregates, the 5xx count and (``check_server``) the server's state afterwards.
    With ``config.peers``: the same workload against ours and each reachable peer, interleaved (see
    ``bench_side_by_side``). ``progress``: a rich Progress (or None); ``count_tokens``: output tokens of a
    response whose server reports no usage; ``log``: one-line messages (a peer skipped)."""
    from mcp2026.bench.report import BenchRun, machine_info
    from mcp2026.bench.workloads import describe

    model = config.model or discover_model(config)
    skipped: dict[str, str] = {}
    peers = []
    for peer in config.peers:
        try:
            peers.append(replace(peer, model=probe_peer(peer, config.timeout_s)))
        except Exception as e:  # noqa: BLE001 - an unreachable peer is skipped, the run goes on
            import httpx

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


def probe_peer(peer: PeerEndpoint, timeout_s: float = 30.0) -> str:
    """The model id to send to ``peer``: its own, or the first its /v1/models lists. Raises an httpx error
    when it does not answer, ValueError when it answers without a model."""
    import httpx

    response = httpx.get(f"{peer.base_url}/v1/models", timeout=min(timeout_s, 10.0))
    response.raise_for_status()
    if peer.model:
        return peer.model
    models = response.json().get("data") or []
    if not models:
        raise ValueError(f"{peer.base_url}/v1/models lists no model; pass --peer-model {peer.name}=MODEL")
    return models[0]["id"]


def endpoint_aggregates(
    results: Sequence[RequestResult], duration_s: float, config: ServeBenchConfig
) -> dict[str, Any]:
    """One endpoint's aggregates: the vLLM metrics, robustness counts, requests sent and where the output
    token counts came from."""
    aggregates = compute_metrics(results, duration_s, config.goodput_ms, config.percentiles)
    aggregates.update(robustness_summary(results))
    aggregates["num_sent"] = len(results)
    aggregates["token_sources"] = dict(Counter(r.token_source for r in results if r.token_source))
    aggregates["num_retried"] = sum(r.retries > 0 for r in results)
    reported = [r for r in results if r.kind == "normal" and r.success and r.cached_tokens is not None]
    prompt_tokens = sum(r.prompt_len for r in reported)
    aggregates["prompt_cache_share"] = (
        sum(r.cached_tokens for r in reported) / prompt_tokens if prompt_tokens else None
    )  # None: the server reports no cached tokens
    return aggregates


# A share of prompt tokens from a server's prefix cache above which a run says so: a workload without shared
# prefixes gets that only from prompts the server saw before (an earlier run with the same seed), which makes
# its TTFT a cache hit's, not a prefill's.
PREFIX_CACHE_NOTE_SHARE = 0.1


def prefix_cache_notes(endpoints: dict[str, dict[str, Any]]) -> list[str]:
    """A note per endpoint whose prompt tokens came largely from its prefix cache."""
    notes = []
    for name, agg in endpoints.items():
        share = agg.get("prompt_cache_share")
        if share is not None and share >= PREFIX_CACHE_NOTE_SHARE:
            notes.append(
                f"{name}: {share:.0%} of prompt tokens came from its prefix cache (its usage's cached_tokens): "
                "shared prefixes (the prefix workload) or prompts it served before, e.g. in an earlier run with "
                "the same --seed; to compare prefills, restart the servers or change --seed"
            )
    return notes


def token_source_notes(endpoints: dict[str, dict[str, Any]]) -> list[str]:
    notes = []
    for name, agg in endpoints.items():
        if agg.get("num_retried"):
            notes.append(
                f"{name}: {agg['num_retried']} requests were sent twice: the server closed an idle keep-alive "
                "connection as the request went out (before any response), so the first never reached it"
            )
        sources = agg.get("token_sources") or {}
        if sources.get("tokenizer"):
            notes.append(
                f"{name}: {sources['tokenizer']} responses carried no usage; their output tokens were counted "
                "by tokenizing the returned text with our tokenizer (approximate)"
            )
        if sources.get("chunks"):
            notes.append(
                f"{name}: {sources['chunks']} responses carried no usage; their output tokens are the number "
                "of streamed chunks"
            )
    return notes


# ---- side by side -------------------------------------------------------------------------------
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
    from mcp2026.bench.report import BenchRun, machine_info
    from mcp2026.bench.workloads import describe

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
    from mcp2026.bench.report import Table

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
    from mcp2026.bench.report import Table

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
