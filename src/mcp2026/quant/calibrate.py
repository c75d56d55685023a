"""Calibration: run real text through the model and record what the DQG decides from.

Per linear: activation statistics (stats.ActivationStatsCollector), a capped random subset of its input
rows (to measure each candidate format's output error), and optionally the diagonal empirical Fisher of
its output, E_t[(dLoss/dy_t)^2] per output channel, from a backward pass on a few samples; it weights
output errors by how much they move the loss. Calibration and evaluation text never overlap: a hash of
each ShareGPT conversation's text puts it in one split (``split_of``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from torch import Tensor, nn

from mcp2026.quant.stats import ActivationStats, ActivationStatsCollector
from mcp2026.sharegpt import sharegpt_texts

SOURCES = ("sharegpt", "random")  # or a path: a ShareGPT-style .json or a plain .txt file


@dataclass(frozen=True)
class CalibrationSettings:
    source: str = "sharegpt"
    num_samples: int = 32
    max_len: int = 512  # tokens per sample at most
    min_len: int = 32  # shorter conversations are skipped
    max_rows: int = 256  # input rows kept per linear for error measurement
    fisher_samples: int = 8  # samples that also run backward (output sensitivities); 0 disables
    seed: int = 0
    # Decay per forward call of the activation statistics' EMA (``ActivationStats.ema_absmax`` / ``ema_second_moment``):
    # 0.999 remembers ~1000 calls, i.e. every sample of a calibration run, weighted towards the later ones.
    ema_decay: float = 0.999

    def __post_init__(self) -> None:
        for name, low in (("num_samples", 1), ("max_len", 2), ("max_rows", 1), ("fisher_samples", 0)):
            if getattr(self, name) < low:
                raise ValueError(f"calibration.{name} must be >= {low}, got {getattr(self, name)}")
        if not 0.0 < self.ema_decay < 1.0:
            raise ValueError(
                f"calibration.ema_decay must be in (0, 1) (the EMA's weight on its past per call), got {self.ema_decay}"
            )


@dataclass
class LayerCalibration:
    rows: Tensor  # (R, K) fp32: a random subset of the inputs this linear saw
    activations: ActivationStats
    output_fisher: Tensor | None = None  # (N,) mean over tokens of (dLoss/dy)^2, None without backward


@dataclass
class Calibration:
    layers: dict[str, LayerCalibration]
    samples: list[Tensor] = field(repr=False)  # the token sequences (for perplexity checks)
    source: str = "sharegpt"
    num_tokens: int = 0

    @property
    def has_fisher(self) -> bool:
        return all(layer.output_fisher is not None for layer in self.layers.values())


def _file_texts(path: Path) -> Iterator[str]:
    if not path.exists():
        raise FileNotFoundError(f"{path}: calibration file not found")
    if path.suffix == ".json":
        yield from sharegpt_texts("calibration", path=path)
    else:
        yield from (p for p in path.read_text(encoding="utf-8").split("\n\n") if p.strip())


def calibration_samples(
    settings: CalibrationSettings, tokenizer: Any | None, vocab_size: int
) -> list[list[int]]:
    """``num_samples`` token sequences of ``min_len``..``max_len`` tokens from the configured source."""
    n, length = settings.num_samples, settings.max_len
    if settings.source == "random":
        g = torch.Generator().manual_seed(settings.seed)
        return [torch.randint(vocab_size, (length,), generator=g).tolist() for _ in range(n)]
    if tokenizer is None:
        raise ValueError(
            f"calibration source {settings.source!r} needs a tokenizer; this model has none (use 'random')"
        )
    if settings.source == "sharegpt":
        texts = sharegpt_texts("calibration", settings.seed)
    else:
        texts = _file_texts(Path(settings.source).expanduser())
    samples = []
    for text in texts:
        ids = tokenizer.encode(text)[:length]
        if len(ids) >= settings.min_len:
            samples.append(ids)
        if len(samples) == n:
            break
    if not samples:
        raise ValueError(
            f"calibration source {settings.source!r} gave no text of >= {settings.min_len} tokens"
        )
    return samples


# ---- running the model ----------------------------------------------------------------------------
class _RowSampler:
    """Keeps up to ``per_call`` random input rows of each call, at most ``max_rows`` in all."""

    def __init__(self, max_rows: int, per_call: int, seed: int) -> None:
        self.max_rows, self.per_call = max_rows, per_call
        self.generator = torch.Generator().manual_seed(seed)
        self.rows: dict[str, list[Tensor]] = {}

    def capture(self, name: str, x: Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1])
        take = torch.randperm(x.shape[0], generator=self.generator)[: self.per_call]
        self.rows.setdefault(name, []).append(x[take.to(x.device)].float().cpu())

    def result(self, name: str) -> Tensor:
        return torch.cat(self.rows[name])[: self.max_rows]


class _FisherHooks:
    """Forward hooks that make each linear's output part of the autograd graph and accumulate the
    squared gradient of the loss with respect to it, per output channel."""

    def __init__(self, model: nn.Module, names: Sequence[str]) -> None:
        self.sums: dict[str, Tensor] = {}
        self.num_tokens = 0
        self.handles = [
            model.get_submodule(n).register_forward_hook(lambda _m, _a, y, n=n: self._track(n, y))
            for n in names
        ]

    def _track(self, name: str, y: Tensor) -> Tensor:
        if not y.requires_grad:  # nothing upstream needs grad: this output becomes a leaf
            y = y.detach().requires_grad_(True)
        y.register_hook(lambda g: self._add(name, g))
        return y

    def _add(self, name: str, grad: Tensor) -> None:
        sq = grad.detach().float().reshape(-1, grad.shape[-1]).pow(2).sum(0).cpu()  # (N,)
        self.sums[name] = self.sums[name] + sq if name in self.sums else sq

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def result(self, name: str) -> Tensor | None:
        return self.sums[name] / max(self.num_tokens, 1) if name in self.sums else None


def _linear_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def _progress(enabled: bool):
    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=Console(stderr=True), transient=True, disable=not enabled,
    )  # fmt: skip


def calibrate(
    model: nn.Module,
    samples: Sequence[Sequence[int]],
    settings: CalibrationSettings = CalibrationSettings(),
    progress: bool = True,
) -> Calibration:
    """Run each sample through ``model`` (no KV cache) and collect per-linear statistics and rows.

    The first ``settings.fisher_samples`` samples also compute logits and backpropagate the next-token
    loss (summed over tokens) to every linear output; the others run in inference mode, where the
    lm_head (not called by the forward) is fed its input, the final hidden state, by hand.
    The lm_head's output Fisher is not the empirical one: for logits it has a closed form, the softmax's
    p(1 - p) per vocabulary row (the KL divergence's curvature), averaged over every calibration token, so
    rows of tokens that never were targets in a few thousand tokens still get their weight.
    """
    names = _linear_names(model)
    head = "lm_head" if "lm_head" in names else None
    device = next(model.parameters()).device
    per_call = max(1, -(-settings.max_rows // len(samples)))
    rows = _RowSampler(settings.max_rows, per_call, settings.seed)
    collector = ActivationStatsCollector(model, settings.ema_decay)
    row_hooks = [
        model.get_submodule(n).register_forward_pre_hook(lambda _m, a, n=n: rows.capture(n, a[0])) for n in names
    ]  # fmt: skip
    fisher = _FisherHooks(model, names) if settings.fisher_samples else None
    tensors = [torch.tensor(list(s), dtype=torch.long) for s in samples]
    num_tokens = 0
    logit_fisher = _LogitFisher() if fisher is not None and head is not None else None
    try:
        with collector, _progress(progress) as bar:
            task = bar.add_task("calibrating", total=len(tensors))
            for i, ids in enumerate(tensors):
                is_fisher = fisher is not None and i < settings.fisher_samples
                if fisher is not None and i == settings.fisher_samples:
                    fisher.remove()
                _run_sample(model, ids.to(device), is_fisher, head, collector, rows, logit_fisher)
                if is_fisher:
                    fisher.num_tokens += len(ids) - 1
                num_tokens += len(ids)
                bar.advance(task)
    finally:
        for handle in row_hooks:
            handle.remove()
        if fisher is not None:
            fisher.remove()
    stats = collector.stats()
    layers = {
        n: LayerCalibration(rows.result(n), stats[n], fisher.result(n) if fisher else None)
        for n in names
        if n in stats
    }
    if logit_fisher is not None and head in layers:
        layers[head].output_fisher = logit_fisher.result()
    return Calibration(layers, tensors, settings.source, num_tokens)


class _LogitFisher:
    """Sum over tokens of p (1 - p) per vocabulary row (the expected Fisher of the logits)."""

    def __init__(self) -> None:
        self.total: Tensor | None = None
        self.num_tokens = 0

    def add(self, logits: Tensor) -> None:
        p = torch.softmax(logits.detach().float(), dim=-1)
        add = (p * (1 - p)).sum(0).cpu()
        self.total = add if self.total is None else self.total + add
        self.num_tokens += logits.shape[0]

    def result(self) -> Tensor | None:
        return None if self.total is None else self.total / max(self.num_tokens, 1)


def _run_sample(
    model: nn.Module,
    ids: Tensor,
    is_fisher: bool,
    head: str | None,
    collector: ActivationStatsCollector,
    rows: _RowSampler,
    logit_fisher: _LogitFisher | None = None,
) -> None:
    positions = torch.arange(len(ids), device=ids.device)
    if is_fisher:
        with torch.enable_grad():
            logits = model.compute_logits(model(ids, positions))  # (T, V)
            loss = F.cross_entropy(logits[:-1].float(), ids[1:], reduction="sum")
            loss.backward()
        if logit_fisher is not None:
            logit_fisher.add(logits)
        return
    with torch.inference_mode():
        hidden = model(ids, positions)  # (T, H)
        if logit_fisher is not None:  # the lm_head runs: its hooks see its input
            logit_fisher.add(model.compute_logits(hidden))
            return
    if head is not None:
        collector.observe(head, hidden)
        rows.capture(head, hidden)
