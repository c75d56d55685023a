"""Tiny quantized models for the export tests: a random HF Llama-family folder with a tokenizer, quantized as a
plan says, and the float weights its quantized linears compute with."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from mcp2026.loading.loader import LoadedModel, load_model
from mcp2026.models.layers import Linear
from mcp2026.quant import dqg, recipe
from mcp2026.quant.plan import QuantPlan
from mcp2026.quant.quant_linear import QuantLinear

from conftest import save_tiny_hf
from gguf_files import save_tiny_tokenizer

COMPUTE_DTYPES = {"int8": torch.bfloat16, "int4": torch.bfloat16}


def logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model.compute_logits(model(ids, torch.arange(len(ids))))


def dequantized_copy(model: nn.Module) -> dict[str, torch.Tensor]:
    """name -> the fp32 weight each linear computes with (what an exact export must hold)."""
    return {
        name: (m.dequantize() if isinstance(m, QuantLinear) else m.weight.detach().float())
        for name, m in model.named_modules()
        if isinstance(m, (QuantLinear, nn.Linear))
    }


def with_weights(model: nn.Module, weights: dict[str, torch.Tensor]) -> nn.Module:
    """``model`` with each quantized linear replaced by a float Linear holding ``weights[name]``."""
    for name, w in weights.items():
        linear = Linear(w.shape[1], w.shape[0], bias=False)
        linear.weight = nn.Parameter(w.clone(), requires_grad=False)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, linear)
    return model


def compiled(
    tmp_path: Path, plan: QuantPlan, arch: str = "llama", tensors: dict | None = None
) -> LoadedModel:
    """The tiny model of ``arch`` with a tokenizer, quantized as ``plan`` says (``tensors``: those it names)."""
    source = save_tiny_tokenizer(save_tiny_hf(tmp_path / "src", arch=arch))
    loaded = load_model(source)
    recipe.apply(loaded.model, dqg.DQGResult("uniform", plan, tensors or {}), COMPUTE_DTYPES, progress=False)
    return loaded
