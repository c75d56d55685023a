"""Which model class runs which architecture name (HF ``architectures`` or GGUF ``general.architecture``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from mcp2026.config import ModelConfig
from mcp2026.errors import UnsupportedArchitectureError
from mcp2026.models import gemma3, llama, moe, phi3
from mcp2026.models.family import ModelFamily

# HF config.json "architectures" entries and GGUF general.architecture values -> implementation.
MODEL_REGISTRY: dict[str, ModelFamily] = {
    "LlamaForCausalLM": llama.FAMILY,
    "MistralForCausalLM": llama.MISTRAL_FAMILY,
    "Qwen2ForCausalLM": llama.QWEN2_FAMILY,
    "Qwen3ForCausalLM": llama.QWEN3_FAMILY,
    "Gemma3ForCausalLM": gemma3.FAMILY,
    "Phi3ForCausalLM": phi3.FAMILY,
    "Qwen3MoeForCausalLM": moe.QWEN3_MOE_FAMILY,
    "MixtralForCausalLM": moe.MIXTRAL_FAMILY,
    "llama": llama.FAMILY,
    "mistral": llama.MISTRAL_FAMILY,
    "qwen2": llama.QWEN2_FAMILY,
    "qwen3": llama.QWEN3_FAMILY,
    "gemma3": gemma3.FAMILY,
    "phi3": phi3.FAMILY,
    "qwen3moe": moe.QWEN3_MOE_FAMILY,
    # llama.cpp writes Mixtral as "llama" with llama.expert_count (llama.FAMILY.gguf_with_experts names it)
}


def resolve_architecture(names: list[str] | str, source: str) -> str:
    """The first supported name, or a clear error listing what is supported."""
    candidates = [names] if isinstance(names, str) else list(names)
    for name in candidates:
        if name in MODEL_REGISTRY:
            return name
    supported = ", ".join(sorted(MODEL_REGISTRY))
    raise UnsupportedArchitectureError(
        f"{source}: architecture {candidates or '(none given)'} is not supported; supported: {supported}"
    )


def family_of(architecture: str) -> ModelFamily:
    return MODEL_REGISTRY[architecture]


def build_model(config: ModelConfig) -> nn.Module:
    return MODEL_REGISTRY[config.architecture].model(config)


# The in-place initialisers torch's layers call from reset_parameters(). On the meta device each of them goes
# through a Python reference decomposition that imports torch._dynamo (~140 MB resident, and triton where
# it is installed) - a cost a model whose weights are loaded right after never needs to pay.
_INITIALISERS = (
    "normal_",
    "uniform_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "trunc_normal_",
    "zeros_",
    "ones_",
)


@contextlib.contextmanager
def _initialisers_skipped() -> Iterator[None]:
    saved = {name: getattr(nn.init, name) for name in _INITIALISERS}
    try:
        for name in saved:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, function in saved.items():
            setattr(nn.init, name, function)


def build_model_skeleton(config: ModelConfig) -> nn.Module:
    """The model for ``config`` on the meta device, its parameters never initialised (they are about to be
    loaded): shapes only, no memory, no initialiser run."""
    with torch.device("meta"), _initialisers_skipped():
        return build_model(config)
