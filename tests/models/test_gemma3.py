"""Gemma 3 against HF transformers on the same random weights (fp32 logits)."""

from __future__ import annotations

import pytest
import torch

from mcp2026.loading.loader import load_model

from conftest import hf_logits, save_tiny_hf

LAYERS = ["sliding_attention", "full_attention", "sliding_attention"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"final_logit_softcapping": 0.5},
        {"num_key_value_heads": 1, "tie": False},
    ],
    ids=["interleaved", "softcap", "mqa-untied"],
)
def test_logits_match_hf(tmp_path, kwargs):
    kwargs = {"tie": True, **kwargs}
    path = save_tiny_hf(
        tmp_path, arch="gemma3", num_hidden_layers=3, layer_types=LAYERS, sliding_window=8, **kwargs
    )
    ids = torch.randint(0, 320, (40,), generator=torch.Generator().manual_seed(1))
    ours = load_model(path, dtype=torch.float32)
    assert ours.config.layer_types == tuple(LAYERS) and ours.config.sliding_window == 8
    with torch.no_grad():
        logits = ours.model.compute_logits(ours.model(ids, torch.arange(len(ids))))
    ref = hf_logits(path, ids)
    assert (logits - ref).abs().max().item() < 1e-4


def test_local_and_global_layers_use_their_own_rotary_base(tmp_path):
    path = save_tiny_hf(tmp_path, arch="gemma3", num_hidden_layers=3, layer_types=LAYERS, sliding_window=8)
    model = load_model(path, dtype=torch.float32).model
    assert not torch.equal(model.rope.cos, model.rope_local.cos)


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("attn_logit_softcapping", 50.0, "attn_logit_softcapping is not supported"),
        ("hidden_activation", "gelu", "hidden_activation 'gelu' is not supported"),
    ],
)
def test_settings_we_would_not_apply_are_refused(tmp_path, field, value, message):
    import json

    from mcp2026.errors import ModelLoadError

    path = save_tiny_hf(tmp_path, arch="gemma3", num_hidden_layers=3, layer_types=LAYERS, sliding_window=8)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(ModelLoadError, match=message):
        load_model(path, dtype=torch.float32)
