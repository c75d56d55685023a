"""Serving metrics with vLLM's ``bench serve`` definitions: a request as the client saw it, the aggregates
(throughputs, TTFT/TPOT/ITL/E2E statistics, goodput), robustness counts and the notes a run adds about where its
token counts came from.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mcp2026.bench.serve_config import GOODPUT_METRICS, ServeBenchConfig


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
