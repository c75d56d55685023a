"""What loading needs to know about one architecture beyond the Llama-style tensors every family shares.

Adding an architecture is one file in ``models/`` that defines its module and a ``ModelFamily``, plus a
registry line. Loading reads the shared names (``loading/names.py``) and this record's additions.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

# A GGUF metadata getter: get("attention.sliding_window", default) reads "<arch>.attention.sliding_window".
GGUFGetter = Callable[..., Any]


def _no_fields(_: Any) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class ModelFamily:
    model: type[nn.Module]
    # Per-layer tensor names (after "model.layers.N." / "blk.N.") -> ours, beyond the shared Llama set
    hf_layer_names: Mapping[str, str] = field(default_factory=dict)
    gguf_layer_names: Mapping[str, str] = field(default_factory=dict)
    # Our per-layer tensors beyond the Llama set that the model takes as they are (e.g. "attn.q_norm.weight")
    layer_tensors: tuple[str, ...] = ()
    # Whether llama.cpp's converter permuted this family's q/k rows for its interleaved rotary layout (Llama
    # and Mistral yes; families llama.cpp runs with NeoX-style rotary, such as Qwen2 and Gemma, no)
    gguf_rope_permuted: bool = True
    # ModelConfig fields beyond the shared ones, read from config.json / from GGUF metadata
    hf_config: Callable[[dict[str, Any]], dict[str, Any]] = _no_fields
    gguf_config: Callable[[GGUFGetter], dict[str, Any]] = _no_fields
