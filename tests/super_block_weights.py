"""Random weights with the K-quants' super-block scales (tests/quant/test_super_blocks.py and the AVX2 build's
tests share them)."""

from __future__ import annotations

import torch

from mcp2026.quant.block_linear import LEVEL_VALUES, BlockWeights
from mcp2026.quant.super_blocks import SuperBlockScales


def super_block_weights(
    n: int, k: int, bits: int | str, group: int, center: int | None = None, seed: int = 0
) -> BlockWeights:
    """Random weights as the K-quants store them: fp16 factors per 256 weights, 6-bit (signed where symmetric)
    integers per group; ``center``: every offset -center x scale (Q3_K, Q6_K, IQ4_XS); bits "levels": IQ4 values."""
    g = torch.Generator().manual_seed(seed)
    supers, groups = k // 256, k // group
    scale_factor = (torch.rand(n, supers, generator=g) * 1e-3 + 1e-4).half().float()
    scale_sub = torch.randint(-32 if center else 0, 64, (n, groups), generator=g, dtype=torch.int8)
    if center:
        offset_factor, offset_sub = -center * scale_factor, scale_sub
    else:
        offset_factor = -(torch.rand(n, supers, generator=g) * 1e-3).half().float()
        offset_sub = torch.randint(0, 64, (n, groups), generator=g, dtype=torch.int8)
    supers_ = SuperBlockScales(scale_factor, scale_sub, offset_factor, offset_sub)
    scale, offset = supers_.expand()
    if bits == "levels":
        u = torch.tensor(LEVEL_VALUES, dtype=torch.uint8)[torch.randint(0, 16, (n, k), generator=g)]
        bits, formats = 8, ("IQ4_XS",)
    else:
        high = 2 * center if center else 2**bits
        u = torch.randint(0, high, (n, k), generator=g, dtype=torch.uint8)
        formats = (f"K{bits}",)
    return BlockWeights(u, scale, offset, group, bits, formats, center, supers_)
