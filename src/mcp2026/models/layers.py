"""Building blocks of a Llama-family decoder: linears and RMSNorm (rotary embeddings: ``models/rotary.py``)."""

from __future__ import annotations

import torch
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
        return ops.rms_norm(x, self.weight, self.eps)

    def add(self, residual: torch.Tensor | None, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(residual + x), residual + x); with residual None, x starts the residual stream (a copy:
        the fused path updates the stream in place)."""
        if residual is None:
            return ops.add_rms_norm(x.clone(), None, self.weight, self.eps)
        return ops.add_rms_norm(residual, x, self.weight, self.eps)
