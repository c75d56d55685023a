"""A file's rope scaling as ModelConfig holds it: transformers' field names and defaults, unknown types refused
with a one-line error, and the context length the scaling extends the model to."""

from __future__ import annotations

from typing import Any

from mcp2026.errors import ModelLoadError
from mcp2026.rope_types import HF_ROPE_TYPES, unsupported_rope_type


def normalized_rope_scaling(
    scaling: dict[str, Any] | None, max_position_embeddings: int, source: str
) -> tuple[dict[str, Any] | None, int]:
    """(rope_scaling under "rope_type" with transformers' defaults, or None for plain RoPE; the context length
    to run). ``max_position_embeddings`` is the file's own (config.json's field, a GGUF's context_length)."""
    if not scaling:
        return None, max_position_embeddings
    scaling = dict(scaling)
    rope_type = scaling.setdefault("rope_type", scaling.pop("type", "default"))
    if rope_type == "default":
        return None, max_position_embeddings
    if rope_type not in HF_ROPE_TYPES:
        raise ModelLoadError(f"{source}: {unsupported_rope_type(rope_type)}")
    if rope_type == "dynamic":
        # transformers' dynamic NTK scales from max_position_embeddings, whatever else rope_scaling holds
        scaling["original_max_position_embeddings"] = max_position_embeddings
    elif scaling.get("original_max_position_embeddings") is None:
        scaling["original_max_position_embeddings"] = max_position_embeddings
    context = max_position_embeddings
    if rope_type in ("dynamic", "yarn") and isinstance(scaling.get("factor"), (int, float)):
        # these two exist to run past the trained context: by `factor` times it (as vLLM derives its max_model_len);
        # linear and llama3 configs already state their extended length in max_position_embeddings
        extended = int(scaling["original_max_position_embeddings"] * scaling["factor"])
        context = max(context, extended)
    return scaling, context
