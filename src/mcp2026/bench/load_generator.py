"""The serving load generator: streams requests to one OpenAI-compatible ``/v1/completions`` endpoint with
vLLM's arrival process (seeded Gamma gaps per request index), a concurrency cap, and optional disconnecting
clients and malformed requests; one run or interleavable phases.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np

from mcp2026.bench.kv_usage import sample_kv_usage
from mcp2026.bench.serve_config import ServeBenchConfig
from mcp2026.bench.serve_metrics import RequestResult
from mcp2026.bench.workloads import BenchRequest

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
            **self.config.extra_body,
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
