"""Accuracy delta of the candidate against the baseline on held-out text, through each arm's own engine.

Windows of held-out ShareGPT text (``quant.perplexity.evaluation_windows``) are teacher-forced through both
engines' paged KV path (``LLMEngine.score``: block tables, the KV codec's write and read, the evictor
after every chunk), so a candidate that differs only in its KV policy is measured as honestly as one with
other weights. As in llama.cpp's perplexity, only the second half of each window is scored. When either
arm compresses or evicts KV, that half runs token by token (as decoding does); otherwise in one chunk
(the same numbers, far faster).

Perplexity change in % = (PPL_baseline - PPL_candidate) / PPL_baseline * 100 (negative = worse) drives the
verdict; its interval is a paired bootstrap over blocks of ``BLOCK_TOKENS`` consecutive scored tokens.
KLD(baseline || candidate) and top-1 agreement are reported as evidence.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from mcp2026.canary.gate import ACCURACY, Measurement, Thresholds
from mcp2026.canary.stats import ppl_change_interval
from mcp2026.quant.perplexity import evaluation_windows

BLOCK_TOKENS = 32  # scored tokens per bootstrap block


@dataclass(frozen=True)
class AccuracyResult:
    num_windows: int
    n_ctx: int
    chunk_size: int  # tokens per forward in the scored half (1 = token by token)
    num_tokens: int  # scored tokens
    num_blocks: int
    baseline_ppl: float
    candidate_ppl: float
    kld: float  # mean KL(baseline || candidate) per scored token, nats
    kld_p99: float
    top1_agreement: float  # share of scored tokens where both arms' argmax agree
    ppl_change_pct: float
    ppl_change_low: float
    ppl_change_high: float

    def measurement(self) -> Measurement:
        return Measurement(
            "ppl_change",
            ACCURACY,
            self.ppl_change_pct,
            "%",
            self.num_blocks,
            self.ppl_change_low,
            self.ppl_change_high,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def scoring_chunk_size(*engines: Any, n_ctx: int) -> int:
    """Token by token when a KV compressor acts between steps; else the scored half in one forward."""
    return 1 if any(e.config.kv_compressor is not None for e in engines) else n_ctx - n_ctx // 2


@torch.inference_mode()
def _score_window(
    baseline: Any, candidate: Any, window: torch.Tensor, chunk_size: int
) -> dict[str, torch.Tensor]:
    """Per scored token: NLL difference (candidate - baseline), both NLLs, KLD, argmax agreement."""
    tokens = [int(t) for t in window]
    n, first = len(tokens), len(tokens) // 2
    targets = window.long()
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("nll_b", "nll_c", "kld", "agree")}
    pairs = zip(
        baseline.score(tokens, first, n, chunk_size, "canary-eval-baseline"),
        candidate.score(tokens, first, n, chunk_size, "canary-eval-candidate"),
    )
    for (start, a), (_, b) in pairs:
        lo, hi = max(start, first), min(start + a.shape[0], n - 1)  # position p predicts token p + 1
        if lo >= hi:
            continue
        la = torch.log_softmax(a[lo - start : hi - start].double(), -1)
        lb = torch.log_softmax(b[lo - start : hi - start].double(), -1)
        target = targets[lo + 1 : hi + 1].unsqueeze(1)
        parts["nll_b"].append(-la.gather(1, target).squeeze(1))
        parts["nll_c"].append(-lb.gather(1, target).squeeze(1))
        parts["kld"].append((la.exp() * (la - lb)).sum(-1).clamp_min(0.0))
        parts["agree"].append((la.argmax(-1) == lb.argmax(-1)).double())
    return {k: torch.cat(v) for k, v in parts.items()}


def measure_accuracy(
    baseline: Any,
    candidate: Any,
    windows: list[torch.Tensor],
    thresholds: Thresholds,
    seed: int = 0,
) -> AccuracyResult:
    """Both engines must be idle. ``windows``: equal-length token windows (``evaluation_windows``)."""
    if not windows:
        raise ValueError("accuracy needs at least one evaluation window (--eval-windows >= 1)")
    n_ctx = len(windows[0])
    limit = min(baseline.max_model_len, candidate.max_model_len)
    if n_ctx > limit:
        raise ValueError(f"--eval-ctx {n_ctx} is longer than the arms' context ({limit} tokens); lower it")
    chunk_size = scoring_chunk_size(baseline, candidate, n_ctx=n_ctx)
    scores = [_score_window(baseline, candidate, w, chunk_size) for w in windows]
    block_sums, block_counts = [], []
    for s in scores:
        diff = s["nll_c"] - s["nll_b"]
        for i in range(0, len(diff), BLOCK_TOKENS):
            block = diff[i : i + BLOCK_TOKENS]
            block_sums.append(float(block.sum()))
            block_counts.append(len(block))
    interval = ppl_change_interval(
        block_sums, block_counts, thresholds.confidence, thresholds.bootstrap_resamples, seed
    )
    nll_b = torch.cat([s["nll_b"] for s in scores])
    nll_c = torch.cat([s["nll_c"] for s in scores])
    kld = torch.cat([s["kld"] for s in scores])
    return AccuracyResult(
        num_windows=len(windows),
        n_ctx=n_ctx,
        chunk_size=chunk_size,
        num_tokens=len(nll_b),
        num_blocks=len(block_sums),
        baseline_ppl=float(nll_b.mean().exp()),
        candidate_ppl=float(nll_c.mean().exp()),
        kld=float(kld.mean()),
        kld_p99=float(torch.quantile(kld, 0.99)) if len(kld) > 1 else float(kld.max()),
        top1_agreement=float(torch.cat([s["agree"] for s in scores]).mean()),
        ppl_change_pct=interval.value,
        ppl_change_low=interval.low,
        ppl_change_high=interval.high,
    )


def held_out_windows(tokenizer: Any, num_windows: int, n_ctx: int, seed: int = 0) -> list[torch.Tensor]:
    """Windows of held-out ShareGPT text (never in the calibration split nor the sampled workload)."""
    if tokenizer is None:
        raise ValueError(
            "accuracy runs on held-out text, which needs a tokenizer; this model has none "
            "(pass --eval-windows 0 to skip accuracy: the verdict then cannot be PROMOTE)"
        )
    if n_ctx < 4:
        raise ValueError(f"--eval-ctx must be >= 4 tokens, got {n_ctx}")
    windows = evaluation_windows(tokenizer, num_windows, n_ctx, seed)
    if len(windows) < num_windows:
        raise ValueError(f"the held-out text gives only {len(windows)} windows of {n_ctx} tokens")
    return windows
