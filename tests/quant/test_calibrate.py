"""Calibration: disjoint text splits, sampled rows, activation stats, output Fisher, hooks cleaned up."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from mcp2026.loading.loader import load_model
from mcp2026.quant.calibrate import CalibrationSettings, calibrate, calibration_samples
from mcp2026.sharegpt import sharegpt_texts, split_of

SETTINGS = CalibrationSettings(source="random", num_samples=3, max_len=48, max_rows=40, fisher_samples=2)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def calibrated(tiny_llama_dir):
    model = load_model(tiny_llama_dir).model
    samples = calibration_samples(SETTINGS, None, 320)
    return model, samples, calibrate(model, samples, SETTINGS, progress=False)


def test_splits_are_disjoint_even_with_duplicates(tmp_path):
    conversations = [{"conversations": [{"from": "human", "value": f"q{i % 7}"}, {"from": "gpt", "value": "a"}]}
                     for i in range(40)]  # fmt: skip
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(conversations))
    calib = list(sharegpt_texts("calibration", 0, path))
    evaluation = list(sharegpt_texts("evaluation", 0, path))
    assert calib and evaluation and not set(calib) & set(evaluation)
    assert len(calib) + len(evaluation) == 40  # duplicates stay together on one side
    assert all(split_of(t) == "calibration" for t in calib)
    assert list(sharegpt_texts("calibration", 0, path)) == calib  # fixed by the seed


def test_samples_from_text_file(tmp_path):
    class Chars:
        def encode(self, text):
            return [ord(c) % 50 for c in text]

    path = tmp_path / "calib.txt"
    path.write_text("short\n\n" + "a long enough paragraph of text " * 3 + "\n\n" + "another paragraph " * 5)
    samples = calibration_samples(
        CalibrationSettings(source=str(path), num_samples=5, max_len=64, min_len=32), Chars(), 50
    )
    assert len(samples) == 2 and all(32 <= len(s) <= 64 for s in samples)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        calibration_samples(CalibrationSettings(source=str(path)), None, 50)


def test_rows_stats_and_hooks(calibrated):
    model, samples, calib = calibrated
    assert calib.num_tokens == 3 * 48 and calib.has_fisher
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert list(calib.layers) == names  # lm_head included although the forward does not call it
    for name, layer in calib.layers.items():
        k = model.get_submodule(name).in_features
        assert layer.rows.shape == (40, k)
        assert layer.activations.num_tokens == calib.num_tokens
        assert (layer.output_fisher >= 0).all() and layer.output_fisher.sum() > 0
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())


def test_rows_are_real_inputs(calibrated):
    model, samples, calib = calibrated
    with torch.inference_mode():
        hidden = torch.cat([model(torch.tensor(s), torch.arange(len(s))) for s in samples])
    rows = calib.layers["lm_head"].rows
    distances = torch.cdist(rows, hidden, compute_mode="donot_use_mm_for_euclid_dist").min(dim=1).values
    assert distances.max() < 1e-4


def test_lm_head_fisher_is_the_softmax_curvature_over_every_token(calibrated):
    # logits have a closed-form Fisher, p (1 - p) per row, averaged over all samples (not only the
    # backward ones): rows that never were a target still get their weight
    model, samples, calib = calibrated
    total, count = torch.zeros(320), 0
    with torch.inference_mode():
        for s in samples:
            ids = torch.tensor(s)
            p = F.softmax(model.compute_logits(model(ids, torch.arange(len(ids)))), -1)
            total += (p * (1 - p)).sum(0)
            count += len(ids)
    assert len(samples) > SETTINGS.fisher_samples
    assert torch.allclose(calib.layers["lm_head"].output_fisher, total / count, rtol=1e-4, atol=1e-7)


def test_ema_decay_setting_reaches_the_statistics(tiny_llama_dir):
    """calibration.ema_decay is the decay of the EMA over calls: ema = d * ema + (1 - d) * batch, from the first
    call's value; two decays give two EMAs, each the formula's, and the same exact means."""
    model = load_model(tiny_llama_dir).model
    samples = calibration_samples(SETTINGS, None, 320)
    settings = dataclasses.replace(SETTINGS, fisher_samples=0)
    runs = {
        d: calibrate(model, samples, dataclasses.replace(settings, ema_decay=d), False) for d in (0.999, 0.2)
    }
    linear = model.layers[0].mlp.down_proj
    batches = []
    handle = linear.register_forward_pre_hook(
        lambda _m, a: batches.append((a[0].detach().reshape(-1, a[0].shape[-1]).double() ** 2).mean(0))
    )
    with torch.inference_mode():
        for s in samples:
            ids = torch.tensor(s)
            model(ids, torch.arange(len(ids)))
    handle.remove()
    for decay, calib in runs.items():
        expected = batches[0]
        for batch in batches[1:]:
            expected = decay * expected + (1 - decay) * batch
        stats = calib.layers["layers.0.mlp.down_proj"].activations
        torch.testing.assert_close(stats.ema_second_moment, expected.float())
    slow, fast = (runs[d].layers["layers.0.mlp.down_proj"].activations for d in (0.999, 0.2))
    assert (slow.ema_second_moment - fast.ema_second_moment).abs().max() > 1e-3 * slow.ema_second_moment.max()
    torch.testing.assert_close(slow.second_moment, fast.second_moment)
