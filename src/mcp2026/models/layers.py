"""Building blocks of a Llama-family decoder: linears, RMSNorm and rotary embeddings (incl. llama3 scaling).

Rotary embeddings use the HF "rotate half" convention; GGUF loaders undo llama.cpp's Q/K row permutation
so one convention serves both formats.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mcp2026.kernels import ops


class Linear(nn.Linear):
    """nn.Linear whose 2-D inputs go through ``ops.dense_linear`` (our GEMV at decode sizes, F.linear beyond),
    the function the fused decode layers call too. Still an nn.Linear: quantization replaces it as one."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return super().forward(x)
        return ops.dense_linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    def add(self, residual: torch.Tensor | None, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(residual + x), residual + x); with residual None, x starts the residual stream (a copy:
        the fused path updates the stream in place)."""
        if residual is None:
            return ops.add_rms_norm(x.clone(), None, self.weight, self.eps)
        return ops.add_rms_norm(residual, x, self.weight, self.eps)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency-dependent rope scaling (long wavelengths divided by `factor`, smooth in between)."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context = float(scaling.get("original_max_position_embeddings", 8192))
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type in (None, "default"):
        return inv_freq.float()
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling).float()
    if rope_type == "linear":
        return (inv_freq / float(scaling["factor"])).float()
    raise ValueError(f"rope_scaling type {rope_type!r} is not supported (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin table; ``forward`` rotates q and k at absolute positions.

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
        inv_freq = rope_inv_freq(width, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # (P, width/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (P, width)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        self.half = width // 2

    def table(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows for the step's positions, (T, 1, rotary_dim); computed once per step for all layers."""
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: (T, heads, hd); cos, sin: (T, 1, rotary_dim)
        rot = 2 * self.half
        if rot < x.shape[-1]:
            return torch.cat((self.apply(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
        x1, x2 = x[..., : self.half], x[..., self.half :]
        rotated = torch.cat((-x2, x1), dim=-1)
        return x * cos + rotated * sin
