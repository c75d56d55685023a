"""The offline canary: both configurations on the same requests, interleaved, then the three release metrics
and the gate's verdict.

Both engines are loaded and held in memory, and warmed up (synthetic tokens, so the prefix cache holds none
of the workload). The request list is cut into blocks of ``block_size`` requests; block i runs on both arms,
baseline first when i is even and candidate first when i is odd (A B B A A B ...), so warm-up effects and
machine drift fall on both arms alike. Within a block all requests are submitted together and stepped to
completion (a small offline batch, continuous batching); TTFT and E2E come from the engine's own request
timestamps (arrival = submission). Decoding is greedy with EOS ignored, so both arms generate the same
number of tokens per request and their latencies compare like for like. Requests of one block share engine
steps, so the P99 intervals resample whole blocks, paired across arms (``stats.percentile_change_interval``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mcp2026 import hardware
from mcp2026.bench.canary_arms import Arm, build_arm, check_comparable
from mcp2026.bench.workloads import BenchRequest, WorkloadSpec, describe, load_workload
from mcp2026.canary.accuracy import AccuracyResult, held_out_windows, measure_accuracy
from mcp2026.canary.bandwidth import BandwidthEstimate, estimate_bandwidth
from mcp2026.canary.config import BASELINE, CANDIDATE, read_thresholds_file
from mcp2026.canary.gate import ACCURACY, LATENCY, GateResult, Measurement, Thresholds, evaluate_gate
from mcp2026.canary.stats import percentile, percentile_change_interval
from mcp2026.serve.canary import read_arm_config
from mcp2026.types import SamplingParams

OK_FINISH = ("stop", "length")


@dataclass(frozen=True)
class CanarySettings:
    baseline: str  # serve YAML
    candidate: str  # serve YAML
    workload: str = "sharegpt"  # or random (bench/workloads.py)
    num_prompts: int = 24
    max_tokens: int = 32  # cap on each request's output length
    input_len: int = 128  # random workload: prompt tokens
    output_len: int = 32  # random workload: output tokens (before the cap)
    block_size: int = 4  # requests per interleaved block (the bootstrap resamples blocks)
    seed: int = 0  # workload sample and bootstrap
    eval_windows: int = 4  # held-out text windows for the accuracy delta (0: skip, the verdict holds)
    eval_ctx: int = 512
    thresholds_file: str | None = None

    def __post_init__(self) -> None:
        for name in ("num_prompts", "max_tokens", "input_len", "output_len", "block_size", "eval_ctx"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.eval_windows < 0:
            raise ValueError(f"--eval-windows must be >= 0, got {self.eval_windows}")
        if self.workload not in ("sharegpt", "random"):
            raise ValueError(f"--workload must be sharegpt or random, got {self.workload!r}")

    def command(self) -> str:
        parts = [f"mcp2026 canary --baseline {self.baseline} --candidate {self.candidate}"]
        parts.append(
            f"--workload {self.workload} --num-prompts {self.num_prompts} --max-tokens {self.max_tokens}"
        )
        if self.workload == "random":
            parts.append(f"--input-len {self.input_len} --output-len {self.output_len}")
        parts.append(f"--block-size {self.block_size} --seed {self.seed}")
        parts.append(f"--eval-windows {self.eval_windows} --eval-ctx {self.eval_ctx}")
        if self.thresholds_file:
            parts.append(f"--thresholds {self.thresholds_file}")
        return " ".join(parts)


@dataclass
class CanaryResult:
    settings: CanarySettings
    thresholds: Thresholds
    gate: GateResult
    arms: dict[str, dict[str, Any]]
    workload: dict[str, Any]
    block_order: list[str]
    latency: dict[str, dict[str, Any]]  # per arm: counts and percentiles (ms)
    agreement: dict[str, Any]
    accuracy: AccuracyResult | None
    bandwidth: dict[str, BandwidthEstimate]
    records: list[dict[str, Any]]
    seconds: float
    created_at: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S%z"))


def merged_thresholds(arm_configs: list[Any], thresholds_file: str | None) -> Thresholds:
    """The baseline YAML's ``canary:`` keys, then the candidate's, then the thresholds file (last wins)."""
    raw: dict[str, float] = {}
    for serve, _ in arm_configs:
        raw.update(dict(serve.canary.threshold_overrides))
    if thresholds_file:
        raw.update(read_thresholds_file(thresholds_file))
    return Thresholds.from_mapping(raw)


def _requests(settings: CanarySettings, arm: Arm, max_model_len: int) -> list[Any]:
    spec = WorkloadSpec(
        settings.workload, settings.num_prompts, settings.seed, settings.input_len, settings.output_len
    )
    loaded = arm.pipeline.loaded
    sampled = load_workload(spec, loaded.tokenizer, loaded.config.vocab_size)
    requests = [
        BenchRequest(r.request_id, r.prompt_token_ids, min(r.output_len, settings.max_tokens))
        for r in sampled
    ]
    too_long = [r.request_id for r in requests if r.prompt_len + r.output_len > max_model_len]
    if too_long:
        raise ValueError(
            f"{len(too_long)} requests (e.g. {too_long[0]}) need more than the arms' {max_model_len}-token "
            "context; lower --input-len/--max-tokens or use a model with a longer context"
        )
    return requests


def _warm_up(engine: Any) -> None:
    vocab = engine.model_config.vocab_size
    prompt = [(7 * i + 3) % vocab for i in range(1, 33)]  # not workload text: the prefix cache stays cold
    engine.generate([prompt, prompt[::-1]], SamplingParams(max_tokens=4, ignore_eos=True))


def run_block(engine: Any, requests: list[Any], arm: str, block: int) -> list[dict[str, Any]]:
    """Submit every request of the block at once, step to completion; one record per request."""
    ids = {
        engine.add_request(r.prompt_token_ids, SamplingParams(max_tokens=r.output_len, ignore_eos=True)): r
        for r in requests
    }
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    records = []
    for request_id, r in ids.items():
        o = finals[request_id]
        ok = o.finish_reason in OK_FINISH and o.first_token_time is not None and o.finish_time is not None
        records.append(
            {
                "arm": arm,
                "block": block,
                "request_id": r.request_id,
                "prompt_len": r.prompt_len,
                "num_output_tokens": len(o.output.token_ids),
                "finish_reason": o.finish_reason,
                "error": o.error,
                "ttft_ms": (o.first_token_time - o.arrival_time) * 1e3 if ok else None,
                "e2e_ms": (o.finish_time - o.arrival_time) * 1e3 if ok else None,
                "token_ids": list(o.output.token_ids),
            }
        )
    return records


def block_order(num_blocks: int) -> list[tuple[int, str]]:
    """A B, B A, A B, B A, ...: each arm runs first in half of the blocks."""
    order = []
    for i in range(num_blocks):
        arms = (BASELINE, CANDIDATE) if i % 2 == 0 else (CANDIDATE, BASELINE)
        order += [(i, a) for a in arms]
    return order


def _cut_at_eos(ids: list[int], eos: frozenset[int]) -> list[int]:
    for i, t in enumerate(ids):
        if t in eos:
            return ids[: i + 1]
    return ids


def greedy_agreement(records: list[dict[str, Any]], eos_token_ids: tuple[int, ...]) -> dict[str, Any]:
    """Per request, both arms' greedy outputs cut after their first EOS (what a client would see): the share
    of requests with identical outputs, and the mean share of matching leading tokens."""
    eos = frozenset(eos_token_ids)
    by_arm: dict[str, dict[str, list[int]]] = {BASELINE: {}, CANDIDATE: {}}
    for r in records:
        if r["finish_reason"] in OK_FINISH:
            by_arm[r["arm"]][r["request_id"]] = _cut_at_eos(r["token_ids"], eos)
    both = sorted(set(by_arm[BASELINE]) & set(by_arm[CANDIDATE]))
    identical, prefix_shares = 0, []
    for request_id in both:
        a, b = by_arm[BASELINE][request_id], by_arm[CANDIDATE][request_id]
        common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        identical += a == b
        prefix_shares.append(common / max(len(a), len(b), 1))
    n = len(both)
    return {
        "num_requests": n,
        "identical_share": identical / n if n else None,
        "mean_matching_prefix_share": sum(prefix_shares) / n if n else None,
    }


def _latency_summary(records: list[dict[str, Any]], arm: str) -> dict[str, Any]:
    mine = [r for r in records if r["arm"] == arm]
    ok = [r for r in mine if r["ttft_ms"] is not None]
    summary: dict[str, Any] = {
        "num_requests": len(mine),
        "num_ok": len(ok),
        "num_failed": len(mine) - len(ok),
    }
    for key in ("ttft_ms", "e2e_ms"):
        values = [r[key] for r in ok]
        for q in (50, 99):
            summary[f"p{q}_{key}"] = percentile(values, q) if values else None
    return summary


def latency_measurements(
    records: list[dict[str, Any]], thresholds: Thresholds, seed: int
) -> list[Measurement]:
    """P99 TTFT and E2E change with a paired block bootstrap: block i of both arms ran the same requests."""
    num_blocks = 1 + max(r["block"] for r in records)
    out = []
    for key, name in (("ttft_ms", "p99_ttft_change"), ("e2e_ms", "p99_e2e_change")):
        blocks = {
            arm: [[r[key] for r in records if r["arm"] == arm and r["block"] == i and r[key] is not None]
                  for i in range(num_blocks)]
            for arm in (BASELINE, CANDIDATE)
        }  # fmt: skip
        if not any(blocks[BASELINE]) or not any(blocks[CANDIDATE]):
            out.append(Measurement(name, LATENCY, None, "ms", missing_reason="an arm finished no request"))
            continue
        iv = percentile_change_interval(
            blocks[BASELINE],
            blocks[CANDIDATE],
            99.0,
            thresholds.confidence,
            thresholds.bootstrap_resamples,
            seed,
            paired=True,
        )
        out.append(Measurement(name, LATENCY, iv.value, "ms", iv.num_samples, iv.low, iv.high))
    return out


def run_canary(settings: CanarySettings, say: Callable[[str], None] = lambda _m: None) -> CanaryResult:
    t0 = time.perf_counter()
    configs = [read_arm_config(settings.baseline), read_arm_config(settings.candidate)]
    thresholds = merged_thresholds(configs, settings.thresholds_file)
    say(f"loading the baseline ({settings.baseline})")
    baseline = build_arm(BASELINE, settings.baseline, configs[0])
    say(f"loading the candidate ({settings.candidate})")
    candidate = build_arm(CANDIDATE, settings.candidate, configs[1])
    check_comparable(baseline, candidate)
    arms = {BASELINE: baseline, CANDIDATE: candidate}
    max_model_len = min(a.engine.max_model_len for a in arms.values())
    requests = _requests(settings, baseline, max_model_len)
    windows = []
    if settings.eval_windows:
        windows = held_out_windows(
            baseline.pipeline.tokenizer, settings.eval_windows, settings.eval_ctx, settings.seed
        )
    say("warming up both engines")
    for arm in arms.values():
        _warm_up(arm.engine)
        arm.engine.stats.reset()
    blocks = [requests[i : i + settings.block_size] for i in range(0, len(requests), settings.block_size)]
    records: list[dict[str, Any]] = []
    order = block_order(len(blocks))
    for step, (i, name) in enumerate(order):
        say(f"block {i + 1}/{len(blocks)} on the {name} ({step + 1}/{len(order)})")
        records += run_block(arms[name].engine, blocks[i], name, i)
    peak = hardware.peak_read_bandwidth()
    bandwidth = {
        name: estimate_bandwidth(
            arm.pipeline.weight_bytes(), arm.engine.cache.bytes_per_token, arm.engine.stats, peak
        )
        for name, arm in arms.items()
    }
    measurements = latency_measurements(records, thresholds, settings.seed)
    accuracy = None
    if windows:
        say(f"accuracy on {len(windows)} held-out windows of {settings.eval_ctx} tokens")
        accuracy = measure_accuracy(baseline.engine, candidate.engine, windows, thresholds, settings.seed)
        measurements.append(accuracy.measurement())
    else:
        measurements.append(
            Measurement("ppl_change", ACCURACY, None, "%", missing_reason="not measured (--eval-windows 0)")
        )
    measurements.append(bandwidth[CANDIDATE].measurement())
    agreement = greedy_agreement(records, baseline.engine.eos_token_ids)
    for r in records:
        del r["token_ids"]  # compared above; the report keeps counts and timings
    return CanaryResult(
        settings=settings,
        thresholds=thresholds,
        gate=evaluate_gate(measurements, thresholds),
        arms={name: arm.describe() for name, arm in arms.items()},
        workload={
            "name": settings.workload,
            "seed": settings.seed,
            "max_tokens": settings.max_tokens,
            "block_size": settings.block_size,
            "num_blocks": len(blocks),
        }
        | describe(requests),
        block_order=[f"{'A' if name == BASELINE else 'B'}{i}" for i, name in order],
        latency={name: _latency_summary(records, name) for name in arms},
        agreement=agreement,
        accuracy=accuracy,
        bandwidth=bandwidth,
        records=records,
        seconds=time.perf_counter() - t0,
    )
