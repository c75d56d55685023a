"""What loading needs to know about one architecture beyond the Llama-style tensors every family shares.

An architecture is a file in ``models/`` that defines its module and a ``ModelFamily``, plus registry lines.
A family that brings tensors or metadata of its own extends this record and the loaders that read it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


def _no_fields(_: Any) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class ModelFamily:
    model: type  # an nn.Module class taking a ModelConfig
    # Whether llama.cpp's converter permuted this family's q/k rows for its interleaved rotary layout (Llama
    # and Mistral yes; families llama.cpp runs with NeoX-style rotary, such as Qwen2 and Gemma, no)
    gguf_rope_permuted: bool = True
    # ModelConfig fields beyond the shared ones, read from config.json
    hf_config: Callable[[dict[str, Any]], dict[str, Any]] = _no_fields
    # ModelConfig fields beyond the shared ones, from GGUF metadata: called with a getter of the
    # "{architecture}.{key}" values (None where absent)
    gguf_config: Callable[[Callable[[str], Any]], dict[str, Any]] = _no_fields
    # Layer tensors this family's checkpoints name differently (the part after the layer prefix -> our name), on
    # top of the shared maps in loading/names.py; Phi-3 stores q/k/v and gate/up fused ("qkv", "gate_up")
    hf_layer_names: Mapping[str, str] = field(default_factory=dict)
    gguf_layer_names: Mapping[str, str] = field(default_factory=dict)
    # Added to every RMSNorm weight of an HF checkpoint: Gemma stores w and scales by (1 + w); its GGUF files
    # already hold 1 + w (llama.cpp's converter adds it)
    hf_norm_offset: float = 0.0
    # The registry name a GGUF of this architecture runs as when its metadata counts experts
    # ("{architecture}.expert_count" > 0): llama.cpp writes Mixtral files as architecture "llama"
    gguf_with_experts: str | None = None
