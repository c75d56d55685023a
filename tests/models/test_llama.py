"""Our decoder against HF transformers on the same random weights (fp32 logits, max abs diff < 1e-4)."""

from __future__ import annotations

import pytest
import torch

from mcp2026.loading.loader import load_model

from conftest import hf_logits, save_tiny_hf


@pytest.mark.parametrize(
    "arch,kwargs",
    [
        ("llama", {}),
        ("llama", {"tie": True}),
        ("qwen2", {}),
        (
            "llama",
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                }
            },
        ),
        ("llama", {"num_key_value_heads": 4, "head_dim": 32}),
        ("mistral", {"sliding_window": 8}),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
        ("qwen3", {}),
        ("qwen3", {"num_key_value_heads": 1, "tie": True}),
    ],
    ids=[
        "llama",
        "tied",
        "qwen2-bias",
        "llama3-rope",
        "mha-headdim",
        "mistral-window",
        "qwen2-window",
        "qwen3",
        "qwen3-mqa-tied",
    ],  # fmt: skip
)
def test_logits_match_hf(tmp_path, arch, kwargs):
    path = save_tiny_hf(tmp_path, arch=arch, **kwargs)
    ids = torch.randint(0, 320, (40,), generator=torch.Generator().manual_seed(1))
    ours = load_model(path, dtype=torch.float32)
    with torch.no_grad():
        logits = ours.model.compute_logits(ours.model(ids, torch.arange(len(ids))))
    ref = hf_logits(path, ids)
    assert (logits - ref).abs().max().item() < 1e-4
