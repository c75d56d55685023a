"""K-quant scales kept per super-block: the packed layout, its size, and every kernel path giving exactly the
results of the same weight with its scales per group (the products are exact in fp32, so bit for bit)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mcp2026.kernels import ops as kernel_ops
from mcp2026.quant.block_linear import BlockEmbedding, BlockLinear, BlockWeights, value_center
from mcp2026.quant.super_blocks import expand_tiles
from super_block_weights import super_block_weights

needs_kernels = pytest.mark.skipif(
    kernel_ops.cpu.load() is None, reason="the block GEMM needs the compiled CPU kernels"
)


CASES = [  # (bits, group, center): Q4_K, Q5_K, Q2_K, Q3_K, Q6_K, IQ4_XS, and bytes (a fused IQ4_XS and Q4_K)
    (4, 32, None),
    (5, 32, None),
    (4, 16, None),
    (4, 16, 4),
    (6, 16, 32),
    ("levels", 32, 128),
    (8, 32, None),
    (8, 16, 32),
]


@pytest.mark.parametrize(("bits", "group", "center"), CASES)
def test_the_packing_keeps_factors_and_integers(bits, group, center):
    blocks = super_block_weights(32, 512, bits, group, center)
    module = BlockLinear(blocks)
    parts = 1 if center else 2
    per = 256 // group
    so = module.scales_offsets
    assert so.dtype == torch.int8 and tuple(so.shape) == (2, 2, parts, 16 * (4 + per))
    # per 16 x 256 weights and part: 16 fp32 factors and 16 x per integers
    assert module.bits_per_weight == module.bits + parts * (64 + 16 * per) * 8 / (16 * 256)
    per_group = BlockLinear(dataclasses.replace(blocks, super_blocks=None)).scales_offsets
    assert torch.equal(expand_tiles(so, group), per_group.float())
    if center is None or center == value_center(module.bits, module.levels):
        assert torch.equal(module.dequantize(), blocks.dequantize())
    else:  # bytes moved to center 128 (u + 128 - center, offset -128 x scale): the same values, rounded anew
        torch.testing.assert_close(module.dequantize(), blocks.dequantize(), rtol=1e-6, atol=1e-7)


@needs_kernels
@pytest.mark.parametrize(("bits", "group", "center"), CASES)
@pytest.mark.parametrize("rows", [1, 3, 5, 33])
def test_every_kernel_path_gives_the_per_group_results_bit_for_bit(bits, group, center, rows):
    kernels = kernel_ops.cpu.load()
    blocks = super_block_weights(64, 512, bits, group, center, seed=rows)
    bias = torch.randn(64)
    module = BlockLinear(blocks, bias)
    per_group = BlockLinear(dataclasses.replace(blocks, super_blocks=None), bias)
    assert module.scales_offsets.dtype == torch.int8 and per_group.scales_offsets.dtype == torch.float32
    x = torch.randn(rows, 512)
    assert torch.equal(module(x), per_group(x))
    assert torch.equal(module(x.bfloat16()), per_group(x.bfloat16()))
    w, so = module.weight, module.scales_offsets
    assert torch.equal(
        kernels.block_gemm_reference(x, w, so), kernels.block_gemm_reference(x, *_packed(per_group))
    )
    assert torch.equal(kernels.block_dequant(w, so, 512), kernels.block_dequant(*_packed(per_group), 512))
    ids = torch.tensor([[0, 63], [17, 5]])
    assert torch.equal(
        BlockEmbedding(module, torch.float32)(ids), BlockEmbedding(per_group, torch.float32)(ids)
    )


def _packed(module: BlockLinear) -> tuple[torch.Tensor, torch.Tensor]:
    return module.weight, module.scales_offsets


def test_rows_regrouping_and_concat_keep_them_exact():
    q4k = super_block_weights(32, 256, 4, 32)
    q6k = super_block_weights(16, 256, 8, 16, center=32, seed=1)
    both = BlockWeights.concat([q4k, q6k])  # a fused qkv of Q4_K q, k and a Q6_K v
    assert both.group_size == 16 and both.center is None and both.super_blocks is not None
    scale, offset = both.super_blocks.expand()
    assert torch.equal(scale, both.scale) and torch.equal(offset, both.offset)
    assert torch.equal(both.dequantize(), torch.cat([q4k.dequantize(), q6k.dequantize()]))
    module = BlockLinear(both)
    assert module.scales_offsets.dtype == torch.int8 and module.scales_offsets.shape[2] == 2
    index = torch.arange(47, -1, -1)
    picked = both.rows(index)
    assert torch.equal(picked.super_blocks.expand()[0], picked.scale)
    # a part with per-group float scales only (Q5_0): the whole weight keeps its scales per group
    plain = dataclasses.replace(super_block_weights(16, 256, 8, 32, seed=2), super_blocks=None)
    mixed = BlockWeights.concat([q4k, plain])
    assert mixed.super_blocks is None
    assert BlockLinear(mixed).scales_offsets.dtype == torch.float32


def test_scaling_keeps_them_only_where_the_products_stay_exact():
    blocks = super_block_weights(16, 256, 4, 32)
    halved = blocks.scaled(0.125)  # a power of two: the factors scale exactly
    assert halved.super_blocks is not None
    assert torch.equal(halved.super_blocks.expand()[0], halved.scale)
    assert blocks.scaled(0.3).super_blocks is None  # the per-group floats, scaled, are what is held


def test_a_part_without_them_in_a_weight_marked_as_having_them_is_an_error():
    blocks = super_block_weights(32, 256, 4, 32)
    parts = blocks.row_parts(16)
    broken = dataclasses.replace(
        parts,
        parts=[
            next(iter(parts.parts)),
            dataclasses.replace(blocks.rows(torch.arange(16)), super_blocks=None),
        ],
    )
    with pytest.raises(ValueError, match="without super-block scales"):
        BlockLinear(broken)
