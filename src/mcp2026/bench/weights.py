"""The ``--weights`` entries the benches accept: a uniform format (int8, int4, ...) or ``dqg:BITS``, a DQG plan at
that average bits per weight (calibrated on ShareGPT when the pipeline loads)."""

from __future__ import annotations

from collections.abc import Sequence

from mcp2026.config import QuantConfig


def dqg_bits(weights: str) -> float | None:
    """BITS of a "dqg:BITS" entry (a positive number), else None."""
    kind, _, bits = weights.partition(":")
    try:
        return float(bits) if kind == "dqg" and float(bits) > 0 else None
    except ValueError:
        return None


def check_weights(weights: Sequence[str], formats: Sequence[str]) -> None:
    """Raise, before anything runs, for an entry that is neither a listed format nor a valid DQG budget."""
    bad = [w for w in weights if w not in formats and dqg_bits(w) is None]
    if bad:
        raise ValueError(
            f"weights must be a list of {', '.join(formats)} or dqg:BITS (e.g. dqg:5); got {bad}"
        )
    for w in weights:
        if dqg_bits(w) is not None:
            try:
                quant_config(w)
            except ValueError as error:
                raise ValueError(f"weights {w!r}: {error}") from None


def quant_config(weights: str) -> QuantConfig:
    """The QuantConfig one ``--weights`` entry stands for."""
    bits = dqg_bits(weights)
    if bits is None:
        return QuantConfig(target_precision=weights)
    return QuantConfig(enable_dqg=True, bits_budget=bits)
