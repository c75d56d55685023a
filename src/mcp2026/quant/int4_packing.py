"""The layouts int4 weights are stored in for the CPU kernels: torch's packed int4 layout (what the modules and
artifacts hold) and our GEMV's 32-wide blocks, with the conversions between them."""

from __future__ import annotations

import functools

import torch
from torch import Tensor


def gemv_layout(q: Tensor, scales_and_zeros: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """q (N, K) in 0..15 and torch's (K/g, N, 2) scales and zeros -> the GEMV kernel's 32-wide blocks: bytes
    (N, K/32, 16) holding elements i (low nibble) and i + 16 (high) of each block, and (N, K/32, 2) fp16
    scale and zero per block (the same values, repeated when a group spans several blocks)."""
    n, k = q.shape
    blocks = q.to(torch.uint8).reshape(n, k // 32, 2, 16)
    packed = (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).contiguous()
    sz = scales_and_zeros.to(torch.float16).transpose(0, 1)  # (N, K/g, 2)
    return packed, sz.repeat_interleave(group_size // 32, dim=1).contiguous()


def pack_int4(q: Tensor) -> Tensor:
    """q (N, K) values 0..15 -> the CPU kernel's packed layout, uint8 (N, K/2)."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)


@functools.cache
def int4pack_block_rows() -> int:
    """Rows per block of torch's packed int4 layout on this CPU: it depends on the kernel torch dispatches to
    (64 with AVX-512, 32 with AVX2), so it is read off one tiny pack, not assumed."""
    q = (torch.arange(64, dtype=torch.int32) // 16).repeat_interleave(2).view(64, 2)  # q[r, :] = r // 16
    first = int(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1).reshape(-1)[0])
    rows = 32 * (first >> 4)  # byte 0 holds row 0 and row rows / 2
    if first & 0xF or rows not in (32, 64):
        raise RuntimeError(f"unknown int4 pack layout in this torch build (first byte {first:#x})")
    return rows


def unpack_int4(packed: Tensor, out_features: int, in_features: int, block_rows: int | None = None) -> Tensor:
    """Inverse of ``pack_int4`` on a CPU whose layout has ``block_rows`` (default: this one's). NOTE: the
    layout is torch's (checked by a round-trip test): blocks of B rows, byte (k, j) of a block holds row j in
    its low nibble and row j + B/2 in its high nibble; the rows past the last full block form one block whose
    byte (k, j) holds rows 2j / 2j + 1 in the low / high nibble."""
    n, k = out_features, in_features
    rows = block_rows or int4pack_block_rows()
    flat = packed.reshape(-1)
    full = n // rows * rows
    blocks = flat[: full * k // 2].view(n // rows, k, rows // 2)  # (nb, K, B/2)
    q = torch.cat([blocks & 0xF, blocks >> 4], dim=2).permute(0, 2, 1).reshape(full, k)
    if n > full:
        tail = flat[full * k // 2 :].view(k, (n - full) // 2)
        tail_q = torch.stack([tail & 0xF, tail >> 4], dim=2).reshape(k, n - full).t()
        q = torch.cat([q, tail_q])
    return q
