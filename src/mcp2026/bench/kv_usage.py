"""KV usage of a server over a serving run, read from its Prometheus ``/metrics`` while the load runs: ours
(``mcp2026_kv_cache_usage_ratio``) and vLLM's (``vllm:kv_cache_usage_perc``, a fraction despite the name).
llama-server exposes no KV gauge (its ``llamacpp:kv_cache_usage_ratio`` was removed in 2025). An endpoint
exposing none is asked once and left alone."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from typing import Any

import httpx

KV_USAGE_METRICS = (
    "mcp2026_kv_cache_usage_ratio",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",  # vLLM before v1
)


def prometheus_values(text: str, names: Iterable[str]) -> dict[str, float]:
    """The values of the named samples in a Prometheus text exposition (labels ignored; the first sample of
    each name wins)."""
    wanted, values = set(names), {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in wanted and name not in values and not line.startswith("#"):
            try:
                values[name] = float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
    return values


def kv_usage_share(text: str) -> tuple[str, float] | None:
    """The first known KV-usage gauge in a Prometheus exposition, as (metric, share of the pool in use)."""
    values = prometheus_values(text, KV_USAGE_METRICS)
    name = next((n for n in KV_USAGE_METRICS if n in values), None)
    return None if name is None else (name, values[name])


async def sample_kv_usage(
    base_url: str, headers: dict[str, str], interval_s: float, t0: float, stop: asyncio.Event
) -> dict[str, Any] | None:
    """Poll ``base_url``'s ``/metrics`` every ``interval_s`` until ``stop`` is set, on a connection of its
    own: {"metric", "t_s", "share"} with times from ``t0`` (perf_counter), or None when the server exposes
    no known gauge."""

    times: list[float] = []
    shares: list[float] = []
    metric = None
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=5.0) as client:
        while True:
            try:
                response = await client.get("/metrics")
                found = kv_usage_share(response.text) if response.status_code == 200 else None
            except httpx.HTTPError:
                found = None
            if found is None and metric is None:
                return None  # nothing to sample here
            if found is not None:
                metric = found[0]
                times.append(round(time.perf_counter() - t0, 3))
                shares.append(found[1])
            try:
                await asyncio.wait_for(stop.wait(), interval_s)
                break
            except asyncio.TimeoutError:
                continue
    return {"metric": metric, "t_s": times, "share": shares}


def join_phases(samples: list[tuple[float, dict[str, Any] | None]]) -> dict[str, Any] | None:
    """One endpoint's phases (offset in seconds of its own sending time, samples) as one timeline."""
    metric, times, shares = None, [], []
    for offset, sample in samples:
        if sample is None:
            continue
        metric = sample["metric"]
        times += [round(offset + t, 3) for t in sample["t_s"]]
        shares += sample["share"]
    return {"metric": metric, "t_s": times, "share": shares} if metric else None
