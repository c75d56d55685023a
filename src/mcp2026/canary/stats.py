"""Percentiles and seeded bootstrap intervals for the canary's metrics (numpy, no torch).

P99 uses linear interpolation between order statistics (numpy's default), so with fewer than 100 samples it
sits between the two largest values. Intervals are percentile bootstraps: resample blocks of samples with
replacement (latency: the requests that ran together; accuracy: runs of consecutive scored tokens),
recompute the statistic, take the central ``confidence`` share of the resampled values.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Interval:
    value: float  # the statistic on the samples as measured
    low: float
    high: float
    num_samples: int  # the smaller arm's count (latency) or the number of blocks (accuracy)


def percentile(values: Sequence[float], q: float) -> float:
    if len(values) == 0:
        raise ValueError("percentile of no samples")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def p99(values: Sequence[float]) -> float:
    return percentile(values, 99.0)


def _central(samples: np.ndarray, confidence: float) -> tuple[float, float]:
    alpha = (1.0 - confidence) / 2.0
    low, high = np.quantile(samples, [alpha, 1.0 - alpha])
    return float(low), float(high)


def _pooled_percentiles(blocks: list[np.ndarray], idx: np.ndarray, q: float) -> np.ndarray:
    """For each row of block indices, the q-th percentile of the chosen blocks' samples pooled."""
    if len({len(b) for b in blocks}) == 1:  # equal blocks: one vectorised gather
        return np.percentile(np.stack(blocks)[idx].reshape(len(idx), -1), q, axis=1)
    return np.array([np.percentile(np.concatenate([blocks[i] for i in row]), q) for row in idx])


def percentile_change_interval(
    baseline: Sequence[Sequence[float]],
    candidate: Sequence[Sequence[float]],
    q: float = 99.0,
    confidence: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
    paired: bool = False,
) -> Interval:
    """The change of the q-th percentile (candidate minus baseline) and its bootstrap interval.

    Samples come in blocks: requests that ran together share engine steps, so their latencies move together
    and the block, not the request, is the unit resampled (a cluster bootstrap; live traffic passes one
    request per block). ``paired``: block i of both arms ran the same requests, so the same block indices
    are drawn for both arms and differences in what the blocks hold cancel.
    """
    b_blocks = [np.asarray(x, dtype=np.float64) for x in baseline]
    c_blocks = [np.asarray(x, dtype=np.float64) for x in candidate]
    if paired:
        if len(b_blocks) != len(c_blocks):
            raise ValueError(f"paired blocks need equal counts, got {len(b_blocks)} and {len(c_blocks)}")
        kept = [(b, c) for b, c in zip(b_blocks, c_blocks) if b.size and c.size]
        b_blocks, c_blocks = [b for b, _ in kept], [c for _, c in kept]
    else:
        b_blocks, c_blocks = [b for b in b_blocks if b.size], [c for c in c_blocks if c.size]
    if not b_blocks or not c_blocks:
        raise ValueError("both arms need at least one sample")
    rng = np.random.default_rng(seed)
    b_idx = rng.integers(0, len(b_blocks), (resamples, len(b_blocks)))
    c_idx = b_idx if paired else rng.integers(0, len(c_blocks), (resamples, len(c_blocks)))
    star = _pooled_percentiles(c_blocks, c_idx, q) - _pooled_percentiles(b_blocks, b_idx, q)
    low, high = _central(star, confidence)
    b_all, c_all = np.concatenate(b_blocks), np.concatenate(c_blocks)
    value = float(np.percentile(c_all, q) - np.percentile(b_all, q))
    return Interval(value, low, high, int(min(b_all.size, c_all.size)))


def ppl_change_pct(nll_diff_sum: float, num_tokens: int) -> float:
    """(PPL_baseline - PPL_candidate) / PPL_baseline in %, from the summed per-token NLL differences
    (candidate minus baseline): 100 * (1 - exp(mean difference)). Negative = the candidate is worse."""
    return 100.0 * -math.expm1(nll_diff_sum / num_tokens)


def ppl_change_interval(
    block_diff_sums: Sequence[float],
    block_token_counts: Sequence[int],
    confidence: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
) -> Interval:
    """The perplexity change in % and its bootstrap interval over blocks of consecutive tokens (paired:
    both arms scored the same tokens; blocks keep neighbouring tokens' correlation inside a sample)."""
    sums = np.asarray(block_diff_sums, dtype=np.float64)
    counts = np.asarray(block_token_counts, dtype=np.float64)
    if sums.size == 0 or sums.size != counts.size or counts.min() <= 0:
        raise ValueError("need one positive token count per block, and at least one block")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, sums.size, (resamples, sums.size))
    star = 100.0 * -np.expm1(sums[idx].sum(axis=1) / counts[idx].sum(axis=1))
    low, high = _central(star, confidence)
    value = ppl_change_pct(float(sums.sum()), int(counts.sum()))
    return Interval(value, low, high, int(sums.size))
