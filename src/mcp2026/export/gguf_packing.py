"""Our quantized values packed into GGUF blocks as they are: int8 rows into Q8_0, int4 groups into Q4_0
(symmetric) or Q4_1 (with zero points). The inverse of ``loading.gguf_blocks``' readers for these types.

Scales go from bf16 (ours) to the blocks' fp16: exact inside fp16's normal range (bf16's 8-bit significand fits
fp16's 11 bits). A Q4_1 block's offset m = zero - 8 * scale is one fp16 rounding away from ours.
A group of 64 or 128 is written as 2 or 4 blocks of 32 with the same scale (and offset): exact, at g32's size.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from mcp2026.errors import ExportError
from mcp2026.export.matrices import Int4Groups, Int8Rows

QK = 32  # weights per block of Q4_0, Q4_1 and Q8_0


def _check_width(name: str, k: int) -> None:
    if k % QK:
        raise ExportError(
            f"{name}: {k} columns do not fill GGUF blocks of {QK}; this layer cannot be exported"
        )


def _fp16_bytes(name: str, values: Tensor) -> np.ndarray:
    """(N, B) fp32 -> (N, B, 2) bytes of fp16; a value fp16 cannot hold is an error naming the tensor."""
    half = values.to(torch.float16)
    if not torch.isfinite(half).all():
        worst = float(values.abs().max())
        raise ExportError(
            f"{name}: a scale of {worst:.3g} lies outside fp16's range; it cannot be written in GGUF"
        )
    return half.numpy().view(np.uint8).reshape(*values.shape, 2)


def _nibbles(u: Tensor) -> np.ndarray:
    """(N, K) values 0..15 -> (N, K/32, 16) bytes: element j in the low nibble, element j + 16 in the high."""
    n, k = u.shape
    blocks = u.numpy().astype(np.uint8).reshape(n, k // QK, 2, 16)
    return blocks[:, :, 0] | (blocks[:, :, 1] << 4)


def q8_0(name: str, m: Int8Rows) -> np.ndarray:
    """(N, K / 32 * 34) bytes: per block its scale (the row's, or the group's when grouped by 32) as fp16, then its
    32 int8 values."""
    n, k = m.q.shape
    _check_width(name, k)
    scale = m.scale if m.grouped else m.scale[:, None].expand(n, k // QK)
    if scale.shape != (n, k // QK):
        raise ExportError(
            f"{name}: int8 groups of {k // scale.shape[1]} have no GGUF type (Q8_0 groups by {QK})"
        )
    d = _fp16_bytes(name, scale)  # (N, B, 2)
    qs = m.q.numpy().view(np.uint8).reshape(n, k // QK, QK)
    return np.concatenate([d, qs], axis=2).reshape(n, -1)


def q4(name: str, m: Int4Groups) -> tuple[str, np.ndarray]:
    """("Q4_0" or "Q4_1", (N, bytes per row)): Q4_0 blocks w = d * (u - 8) for symmetric groups, else Q4_1
    blocks w = d * u + m with m = zero - 8 * scale."""
    n, k = m.u.shape
    _check_width(name, k)
    if m.group_size % QK:
        raise ExportError(
            f"{name}: int4 groups of {m.group_size} do not fill GGUF blocks of {QK}; compile it with group_size 32"
        )
    repeat = m.group_size // QK
    scale = m.scale.repeat_interleave(repeat, dim=1)  # (N, K/32)
    parts = [_fp16_bytes(name, scale)]
    kind = "Q4_0"
    if not m.symmetric:
        kind = "Q4_1"
        offset = m.zero.repeat_interleave(repeat, dim=1) - 8 * scale
        parts.append(_fp16_bytes(name, offset))
    parts.append(_nibbles(m.u))
    return kind, np.concatenate(parts, axis=2).reshape(n, -1)
