"""Our decoder against HF transformers on the same random weights (fp32 logits, max abs diff < 1e-4)."""

from __future__ import annotations

import pytest
import torch

from mcp2026.loading.loader import load_model
from mcp2026.quant.linear import quantize_
from mcp2026.quant.plan import QuantPlan

from conftest import hf_logits, save_tiny_hf, tiny_random_model


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


def test_a_quantized_output_projection_gives_fp32_logits_under_bf16_activations():
    """The quantized lm_head computes in fp32: bf16 hidden states get its fp32 logits as they are, not rounded to
    bf16 first (a dense bf16 head still computes in bf16)."""
    model = tiny_random_model()[0]
    quantize_(model, QuantPlan({"lm_head": "int8"}))
    hidden = torch.randn(3, model.config.hidden_size).bfloat16()
    logits = model.compute_logits(hidden)
    assert logits.dtype == torch.float32
    assert torch.equal(logits, model.lm_head(hidden.float()))
    assert not torch.equal(logits, logits.bfloat16().float())  # not bf16 numbers widened
