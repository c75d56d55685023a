"""RoPE scaling: the types a model may name and the fields each needs; a model config checks its scaling here."""

from __future__ import annotations

from typing import Any


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


# rope_scaling types a config.json may name (transformers' names); "freq_factors" is llama.cpp's per-dimension
# divisors, read from a GGUF's rope_freqs tensor (how its converter stores Llama 3.1 scaling).
HF_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
ROPE_TYPES = (*HF_ROPE_TYPES, "freq_factors")
# The fields each type cannot go without (loaders fill original_max_position_embeddings as transformers does).
ROPE_REQUIRED_FIELDS = {
    "linear": ("factor",),
    "dynamic": ("factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "llama3": ("factor", "original_max_position_embeddings"),
    "freq_factors": ("freq_factors",),
}


def unsupported_rope_type(rope_type: Any) -> str:
    return (
        f"rope scaling type {rope_type!r} is not supported (supported: {', '.join(HF_ROPE_TYPES)}); "
        "run a model that uses one of these"
    )


def check_rope_scaling(scaling: dict[str, Any], head_dim: int) -> None:
    rope_type = scaling.get("rope_type")
    _require(rope_type in ROPE_TYPES, f"model config: {unsupported_rope_type(rope_type)}")
    for name in ROPE_REQUIRED_FIELDS.get(rope_type, ()):
        _require(
            scaling.get(name) is not None,
            f"model config: rope_scaling type {rope_type!r} needs the field {name!r}; add it to rope_scaling",
        )
    if "factor" in ROPE_REQUIRED_FIELDS.get(rope_type, ()):
        _require(
            float(scaling["factor"]) > 0,
            f"model config: rope_scaling factor must be > 0, got {scaling['factor']}",
        )
    _require(
        float(scaling.get("partial_rotary_factor") or 1.0) == 1.0,
        "model config: rope_scaling partial_rotary_factor is not supported (every head dimension rotates)",
    )
    if rope_type == "freq_factors":
        factors = scaling["freq_factors"]
        _require(
            len(factors) == head_dim // 2 and all(f > 0 for f in factors),
            f"model config: rope_scaling freq_factors must be {head_dim // 2} positive numbers (head_dim / 2), "
            f"got {len(factors)}",
        )
