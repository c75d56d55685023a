"""Which model class runs which architecture name (HF ``architectures`` or GGUF ``general.architecture``)."""

from __future__ import annotations

from torch import nn

from mcp2026.config import ModelConfig
from mcp2026.errors import UnsupportedArchitectureError
from mcp2026.models.llama import LlamaForCausalLM

# HF config.json "architectures" entries and GGUF general.architecture values -> implementation.
MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
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


def build_model(config: ModelConfig) -> nn.Module:
    return MODEL_REGISTRY[config.architecture](config)
