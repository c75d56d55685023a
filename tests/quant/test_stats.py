"""Weight moments on known distributions and the activation statistics collector."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mcp2026.quant.stats import ActivationStatsCollector, model_weight_stats, weight_stats


def test_normal_weights():
    torch.manual_seed(0)
    stats = weight_stats(torch.randn(1000, 1000) * 0.02)
    assert stats.sigma == pytest.approx(0.02, rel=0.01)
    assert abs(stats.skewness) < 0.02 and abs(stats.kurtosis) < 0.05
    assert stats.outlier_ratio == pytest.approx(0.0027, abs=0.0005)
    assert not stats.needs_precompensation


def test_exponential_weights_are_skewed_and_heavy_tailed():
    torch.manual_seed(0)
    stats = weight_stats(torch.empty(1000, 1000).exponential_())
    assert stats.skewness == pytest.approx(2.0, abs=0.1)
    assert stats.kurtosis == pytest.approx(6.0, abs=0.6)
    assert stats.needs_precompensation


def test_constant_weights_have_zero_moments():
    stats = weight_stats(torch.full((4, 4), 0.5))
    assert stats.sigma == 0 and stats.skewness == 0 and stats.kurtosis == 0 and stats.absmax == 0.5


def test_model_weight_stats_names_linears():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    assert set(model_weight_stats(model)) == {"0", "2"}


def test_activation_collector_exact_and_ema():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    batches = [torch.randn(3, 5, 4) * torch.tensor([1.0, 2.0, 3.0, 4.0]) for _ in range(4)]
    with ActivationStatsCollector(model, decay=0.5, include=lambda name: name == "0") as collector:
        for x in batches:
            model(x)
    stats = collector.stats()
    assert set(stats) == {"0"}
    s = stats["0"]
    flat = torch.cat([x.reshape(-1, 4) for x in batches])
    assert s.num_tokens == 60
    assert torch.allclose(s.absmax, flat.abs().amax(0))
    assert torch.allclose(s.second_moment, (flat**2).mean(0))
    assert torch.allclose(s.mean_abs, flat.abs().mean(0))
    assert torch.allclose(s.sigma, flat.double().std(0, unbiased=False).float(), atol=1e-5)
    ema = batches[0].reshape(-1, 4).abs().amax(0)
    for x in batches[1:]:
        ema = 0.5 * ema + 0.5 * x.reshape(-1, 4).abs().amax(0)
    assert torch.allclose(s.ema_absmax, ema)
    model(batches[0])  # hooks removed on exit
    assert collector.stats()["0"].num_tokens == 60


def test_collector_rejects_bad_decay():
    with pytest.raises(ValueError, match="decay"):
        ActivationStatsCollector(nn.Linear(2, 2), decay=1.0)
