"""Per-layer weight statistics and per-input-channel activation statistics for the DQG.

Weights: sigma, Fisher-Pearson skewness, excess kurtosis, outlier ratio, absmax; the
pre-compensation trigger is |skew| > 0.8 or kurtosis > 5. Activations: forward pre-hooks on linears
accumulate per-input-channel absmax and second moment, as an EMA (decay per batch from
``CalibrationSettings.ema_decay``, 0.999 by default) and as exact means over everything seen.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

SKEW_LIMIT = 0.8
KURTOSIS_LIMIT = 5.0
OUTLIER_SIGMAS = 3.0  # a weight is an outlier when |w - mean| > 3 sigma (0.27% for a normal)


@dataclass(frozen=True)
class WeightStats:
    numel: int
    mean: float
    sigma: float
    skewness: float  # Fisher-Pearson g1 = m3 / m2^1.5
    kurtosis: float  # excess: m4 / m2^2 - 3 (0 for a normal)
    outlier_ratio: float  # share with |w - mean| > OUTLIER_SIGMAS * sigma
    absmax: float

    @property
    def needs_precompensation(self) -> bool:
        return abs(self.skewness) > SKEW_LIMIT or self.kurtosis > KURTOSIS_LIMIT


def weight_stats(w: Tensor) -> WeightStats:
    """Moments in float64 over all entries of ``w``."""
    x = w.detach().reshape(-1).double()
    mean = x.mean()
    d = x - mean
    m2 = (d**2).mean()
    sigma = m2.sqrt()
    safe_m2 = m2.clamp_min(1e-300)
    return WeightStats(
        numel=x.numel(),
        mean=mean.item(),
        sigma=sigma.item(),
        skewness=((d**3).mean() / safe_m2**1.5).item() if m2 > 0 else 0.0,
        kurtosis=((d**4).mean() / safe_m2**2 - 3.0).item() if m2 > 0 else 0.0,
        outlier_ratio=(d.abs() > OUTLIER_SIGMAS * sigma).double().mean().item() if m2 > 0 else 0.0,
        absmax=x.abs().max().item(),
    )


def model_weight_stats(model: nn.Module) -> dict[str, WeightStats]:
    """name -> WeightStats for every nn.Linear in the model."""
    return {name: weight_stats(m.weight) for name, m in model.named_modules() if isinstance(m, nn.Linear)}


@dataclass(frozen=True)
class ActivationStats:
    """Per input channel (K,) float32 tensors over the calibration set."""

    num_tokens: int
    absmax: Tensor  # exact maximum of |x|
    mean_abs: Tensor  # exact mean of |x| (AWQ's channel magnitude)
    mean: Tensor
    second_moment: Tensor  # exact mean of x^2
    ema_absmax: Tensor  # EMA over batches of each batch's max |x|
    ema_second_moment: Tensor  # EMA over batches of each batch's mean x^2

    @property
    def sigma(self) -> Tensor:
        return (self.second_moment - self.mean**2).clamp_min(0).sqrt()


class _ChannelAccumulator:
    """Running sums for one linear's input; float64 so long calibration runs stay exact."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.num_tokens = 0
        self.sums: dict[str, Tensor] = {}

    def update(self, x: Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).double()  # (T, K)
        batch_absmax, batch_sq = x.abs().amax(0), (x**2).mean(0)
        if not self.sums:
            self.sums = {
                "sum": x.sum(0),
                "sum_abs": x.abs().sum(0),
                "sum_sq": x.pow(2).sum(0),
                "absmax": batch_absmax,
                "ema_absmax": batch_absmax,
                "ema_sq": batch_sq,
            }
        else:
            s = self.sums
            s["sum"] += x.sum(0)
            s["sum_abs"] += x.abs().sum(0)
            s["sum_sq"] += x.pow(2).sum(0)
            s["absmax"] = torch.maximum(s["absmax"], batch_absmax)
            s["ema_absmax"] = self.decay * s["ema_absmax"] + (1 - self.decay) * batch_absmax
            s["ema_sq"] = self.decay * s["ema_sq"] + (1 - self.decay) * batch_sq
        self.num_tokens += x.shape[0]

    def result(self) -> ActivationStats:
        s, n = self.sums, max(self.num_tokens, 1)
        return ActivationStats(
            num_tokens=self.num_tokens,
            absmax=s["absmax"].float(),
            mean_abs=(s["sum_abs"] / n).float(),
            mean=(s["sum"] / n).float(),
            second_moment=(s["sum_sq"] / n).float(),
            ema_absmax=s["ema_absmax"].float(),
            ema_second_moment=s["ema_sq"].float(),
        )


class ActivationStatsCollector:
    """Forward pre-hooks on the model's nn.Linear modules (optionally filtered by name).

    The EMA starts at the first batch's value (no bias toward zero) and then moves by ``1 - decay``
    per forward call. Use as a context manager, or ``attach()`` / ``remove()``.
    """

    def __init__(
        self, model: nn.Module, decay: float = 0.999, include: Callable[[str], bool] | None = None
    ) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        self.model, self.decay = model, decay
        self.names = [
            n
            for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and (include is None or include(n))
        ]
        self._accumulators = {name: _ChannelAccumulator(decay) for name in self.names}
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def attach(self) -> ActivationStatsCollector:
        if not self._handles:
            for name in self.names:
                accumulator = self._accumulators[name]
                hook = self.model.get_submodule(name).register_forward_pre_hook(
                    lambda _m, args, a=accumulator: a.update(args[0])
                )
                self._handles.append(hook)
        return self

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> ActivationStatsCollector:
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def observe(self, name: str, x: Tensor) -> None:
        """Feed one input of linear ``name`` by hand (e.g. the lm_head input when logits are not computed)."""
        self._accumulators[name].update(x)

    def stats(self, names: Iterable[str] | None = None) -> dict[str, ActivationStats]:
        """name -> ActivationStats for each hooked linear that has seen at least one batch."""
        chosen = self.names if names is None else list(names)
        return {n: self._accumulators[n].result() for n in chosen if self._accumulators[n].num_tokens}
