"""Phi-3 / Phi-4-mini against HF transformers on the same random weights: fused checkpoint tensors, a sliding window
shorter than the sequence, partial rotary (plain path and the fused decode path), and clear errors for bad input."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from mcp2026.config import EngineConfig, KVConfig
from mcp2026.engine.engine import LLMEngine
from mcp2026.errors import ModelLoadError
from mcp2026.loading.loader import load_model

from conftest import count_fused_calls, hf_logits, save_tiny_hf

IDS = torch.randint(0, 320, (40,), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"sliding_window": 8},
        {"partial_rotary_factor": 0.75, "tie_word_embeddings": True},
        {"partial_rotary_factor": 0.5, "sliding_window": 8, "num_key_value_heads": 4},
    ],
    ids=["phi3", "window", "partial-rotary-tied", "partial-rotary-window-mha"],
)
def test_logits_match_hf(tmp_path, overrides):
    path = save_tiny_hf(tmp_path, arch="phi3", **overrides)
    ours = load_model(path, dtype=torch.float32)
    assert ours.config.sliding_window == overrides.get("sliding_window")
    factor = overrides.get("partial_rotary_factor")
    assert ours.config.rotary_dim == (None if factor is None else int(16 * factor))
    with torch.no_grad():
        logits = ours.model.compute_logits(ours.model(IDS, torch.arange(len(IDS))))
    assert (logits - hf_logits(path, IDS)).abs().max().item() < 1e-4


def test_window_changes_the_logits(tmp_path):
    """The window test above can fail: the same weights without the window give other logits past it."""
    windowed = load_model(save_tiny_hf(tmp_path / "w", arch="phi3", sliding_window=8), dtype=torch.float32)
    full = load_model(save_tiny_hf(tmp_path / "f", arch="phi3"), dtype=torch.float32)
    with torch.no_grad():
        a = windowed.model.compute_logits(windowed.model(IDS, torch.arange(len(IDS))))
        b = full.model.compute_logits(full.model(IDS, torch.arange(len(IDS))))
    assert torch.equal(a[:8], b[:8])
    assert (a[8:] - b[8:]).abs().max().item() > 1e-2


@pytest.mark.usefixtures("kernels")
def test_partial_rotary_decode_through_the_fused_layers_matches_hf(tmp_path, monkeypatch):
    """Token by token over the paged cache: each step runs the compiled layer calls (rotary inside the kernel)."""
    path = save_tiny_hf(tmp_path, arch="phi3", partial_rotary_factor=0.75)
    loaded = load_model(path, dtype=torch.float32)
    calls = count_fused_calls(monkeypatch)
    engine = LLMEngine(loaded.model, loaded.config, None, EngineConfig(KVConfig(num_blocks=16)))
    ids = IDS[:24].tolist()
    logits = torch.cat([c.logits for c in engine.score(ids, prompt_len=4, chunk_size=1)])
    assert calls[0] >= 2 * 20  # both layers of every one-token step took the fused path
    assert (logits.float() - hf_logits(path, IDS[:24])).abs().max().item() < 1e-4


def _rewrite(path, edit) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("fused", ["self_attn.qkv_proj", "mlp.gate_up_proj"])
def test_a_fused_tensor_with_the_wrong_row_count_is_a_shape_error(tmp_path, fused):
    path = save_tiny_hf(tmp_path, arch="phi3")
    name = f"model.layers.1.{fused}.weight"
    _rewrite(path, lambda t: t.__setitem__(name, t[name][:-16].contiguous()))
    with pytest.raises(
        ModelLoadError, match=r"has shape \((112|240), 64\) but the config implies (128|256) rows"
    ):
        load_model(path)


def test_a_config_with_another_activation_is_refused(tmp_path):
    path = save_tiny_hf(tmp_path, arch="phi3")
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "hidden_act": "gelu"}))
    with pytest.raises(ModelLoadError, match="hidden_act 'gelu' is not supported"):
        load_model(path)
