"""Rotary position embeddings and their context-extension scalings, computed as transformers'
``modeling_rope_utils`` computes them: linear, dynamic NTK, YaRN, Llama 3.1, and llama.cpp's per-dimension
frequency factors (how its converter stores Llama 3.1 scaling in a GGUF).

Every scaling ends up in the precomputed cos/sin tables (YaRN's attention factor multiplies them, as in
transformers), so the kernels that rotate q and k from the tables (``ops.rope_``, the fused decode layers) run
every type unchanged. Tables use the HF "rotate half" convention; GGUF loaders undo llama.cpp's Q/K row
permutation so one convention serves both formats.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

# Tables are computed on the host whatever the default device: a model built on the meta device (a skeleton
# about to be loaded) still gets real tables, and the meta device's reference ops would import torch._dynamo
# (~140 MB resident). The module moves them with the model.
_HOST = torch.device("cpu")


def default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """theta^(-2i/d) for i < d/2, in float64 (the scalings below work on it before the cast to float32)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=_HOST) / head_dim))


def _llama3(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by ``factor``, short ones kept, a smooth blend in between."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature, eq. 21 of the paper: 0.1 * mscale * ln(scale) + 1."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(scaling: dict[str, Any]) -> float:
    """The factor YaRN multiplies cos and sin by (so q.k by its square): ``attention_factor`` when given, else
    derived from ``factor`` (and ``mscale`` / ``mscale_all_dim`` when both are set)."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all_dim))
    return _yarn_mscale(factor)


def _yarn(inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN: dimensions that turn fewer than ``beta_slow`` times over the original context are interpolated
    (divided by ``factor``), those that turn more than ``beta_fast`` times are kept, a linear ramp between."""
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(num_rotations: float) -> float:
        """The dimension whose wavelength fits ``num_rotations`` times in the original context."""
        return head_dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # the ramp needs a non-empty interval
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64, device=_HOST) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1: keep the trained frequency, 0: interpolate it
    return (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies (hd/2,) float32 of every type whose frequencies do not depend on the position."""
    inv_freq = default_inv_freq(head_dim, theta)
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq.float()
    if rope_type == "linear":
        return (inv_freq / float(scaling["factor"])).float()
    if rope_type == "llama3":
        return _llama3(inv_freq, scaling).float()
    if rope_type == "yarn":
        return _yarn(inv_freq, head_dim, theta, scaling).float()
    if rope_type == "freq_factors":  # llama.cpp: theta_i = p * base^(-2i/d) / freq_factors[i]
        return (inv_freq / torch.tensor(scaling["freq_factors"], dtype=torch.float64, device=_HOST)).float()
    raise ValueError(f"rope_scaling type {rope_type!r} has no position-independent frequencies")


def dynamic_ntk_angles(
    head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any]
) -> torch.Tensor:
    """Dynamic NTK rotation angles (P, hd/2): position p uses the base transformers computes for a sequence of
    length max(p + 1, original), theta * (factor * len / original - (factor - 1)) ^ (d / (d - 2)).

    NOTE: transformers recomputes one base for the whole sequence from its current length, so with a cache its
    keys were rotated with the base of the length at the step that wrote them, and a prompt longer than the
    original context is rotated entirely with the base of its full length. A paged cache rotates each key once,
    at its position; a per-position base reproduces transformers exactly for contexts up to the original length
    and for token-by-token decoding past it (each new token's length is p + 1), and differs from it only for
    positions past the original length that a single forward pass (a long prefill chunk) covers at once.
    """
    factor = float(scaling["factor"])
    original = int(scaling["original_max_position_embeddings"])
    lengths = torch.arange(1, max_positions + 1, dtype=torch.float64, device=_HOST).clamp(
        min=original
    )  # (P,)
    bases = theta * (factor * lengths / original - (factor - 1)) ** (head_dim / (head_dim - 2))
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device=_HOST) / head_dim  # (hd/2,)
    inv_freq = (1.0 / bases[:, None] ** exponents[None, :]).float()  # (P, hd/2)
    return torch.arange(max_positions, dtype=torch.float32, device=_HOST)[:, None] * inv_freq


def rope_angles(
    head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None
) -> tuple[torch.Tensor, float]:
    """(rotation angles (P, hd/2) for positions 0 .. P-1, the factor cos and sin are multiplied by)."""
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "dynamic":
        return dynamic_ntk_angles(head_dim, max_positions, theta, scaling), 1.0
    inv_freq = rope_inv_freq(head_dim, theta, scaling)
    angles = torch.outer(
        torch.arange(max_positions, dtype=torch.float32, device=_HOST), inv_freq
    )  # (P, hd/2)
    return angles, yarn_attention_factor(scaling) if rope_type == "yarn" else 1.0


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin table; ``apply`` rotates q and k at absolute positions.

    ``rotary_dim`` (partial rotary): only each head's first ``rotary_dim`` dims rotate, with frequencies over
    ``rotary_dim`` as transformers computes them; the tables are (P, rotary_dim) and the other dims pass through."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__()
        width = rotary_dim or head_dim  # the dims that rotate
        angles, attention_factor = rope_angles(width, max_positions, theta, scaling)  # (P, width/2)
        # Half the rotated width: both halves of a head turn by the same angles, so a step's rows are widened
        # on read (a 32k-position, 256-wide table pair is 64 MiB instead of 128)
        self.register_buffer("cos", angles.cos() * attention_factor, persistent=False)
        self.register_buffer("sin", angles.sin() * attention_factor, persistent=False)
        self.half = width // 2

    def table(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows for the step's positions, (T, 1, rotary_dim); computed once per step for all layers."""
        cos, sin = self.cos[positions].to(dtype), self.sin[positions].to(dtype)
        return torch.cat((cos, cos), dim=-1).unsqueeze(1), torch.cat((sin, sin), dim=-1).unsqueeze(1)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: (T, heads, hd); cos, sin: (T, 1, rotary_dim)
        rot = 2 * self.half
        if rot < x.shape[-1]:
            return torch.cat((self.apply(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
        x1, x2 = x[..., : self.half], x[..., self.half :]
        rotated = torch.cat((-x2, x1), dim=-1)
        return x * cos + rotated * sin
