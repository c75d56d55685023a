"""Tiny random Phi-3 checkpoints (config.json + model.safetensors, fused qkv_proj and gate_up_proj) built with
transformers, for the model and GGUF loading tests."""

from __future__ import annotations

from pathlib import Path

import torch


def save_tiny_phi3(path: Path, seed: int = 0, **overrides) -> Path:
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(seed)
    fields = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    fields.update(overrides)
    model = Phi3ForCausalLM(Phi3Config(**fields))
    with torch.no_grad():  # random init gives tiny logits; norms away from 1 make differences show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return path
