"""BlockLinear / BlockEmbedding: the GEMMs against an exact oracle (the dequantized weight times the activations
rounded as the kernels round them), the packing round trip, and mixed-format concatenation."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mcp2026.kernels import ops as kernel_ops
from mcp2026.quant.block_linear import (
    LEVEL_VALUES,
    BlockEmbedding,
    BlockLinear,
    BlockWeights,
    kernels_unavailable,
    pack_byte_tiles,
    pack_int4_tiles,
    pack_int5_tiles,
    pack_int6_tiles,
    packable,
    tile_scales,
    value_center,
)

needs_kernels = pytest.mark.skipif(
    kernel_ops.cpu.load() is None, reason="the block GEMM needs the compiled CPU kernels"
)


def random_blocks(
    n: int, k: int, bits: int, group: int, seed: int = 0, fp16: bool = False, center: int | None = None
) -> BlockWeights:
    """Random blocks; ``fp16``: scales and offsets on fp16's grid (as Q4_0 / Q4_1 / Q8_0 store them);
    ``center``: symmetric, values 0 .. 2 center - 1 and every offset -center x scale (as Q4_0, Q6_K store them)."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 2 * center if center else 2**bits, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(n, k // group, generator=g) * 0.01 + 0.001
    offset = -(2 ** (bits - 1)) * scale * (1 + 0.1 * torch.randn(n, k // group, generator=g))
    if fp16:
        scale, offset = scale.half().float(), offset.half().float()
    if center:
        offset = -center * scale
    return BlockWeights(u, scale, offset, group, bits, (f"test{bits}",), center)


def level_blocks(n: int, k: int, seed: int = 0, fp16: bool = False, formats=("IQ4_NL",)) -> BlockWeights:
    """Random IQ4 blocks: every value one of the 16 levels (plus 128), offset -128 scale."""
    g = torch.Generator().manual_seed(seed)
    u = torch.tensor(LEVEL_VALUES, dtype=torch.uint8)[torch.randint(0, 16, (n, k), generator=g)]
    scale = torch.rand(n, k // 32, generator=g) * 0.01 + 0.001
    if fp16:
        scale = scale.half().float()
    return BlockWeights(u, scale, -128 * scale, 32, 8, formats)


def round_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels see it: int8 per 32 values with step max|x| / 127, rounded half to even."""
    m, k = x.shape
    xb = x.float().view(m, k // 32, 32)
    step = xb.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(step > 0, 1 / step, torch.zeros_like(step))
    return (torch.round(xb * inv) * step).view(m, k)


def test_packable_shapes():
    assert packable((64, 256)) and packable((16, 32))
    assert not packable((24, 256)) and not packable((64, 48))


@pytest.mark.parametrize(
    ("bits", "group"), [(4, 32), (5, 32), (6, 32), (8, 32), (4, 16), (5, 16), (6, 16), (8, 16)]
)
def test_dequantize_round_trips_the_packing(bits, group):
    blocks = random_blocks(48, 128, bits, group)
    module = BlockLinear(blocks)
    assert torch.equal(module.dequantize(), blocks.dequantize())
    rows = torch.tensor([0, 17, 47, 17])
    assert torch.equal(module.dequantize_rows(rows), blocks.dequantize()[rows])


@pytest.mark.parametrize(
    ("bits", "group"), [(4, 32), (5, 32), (6, 32), (8, 32), (4, 16), (5, 16), (6, 16), (8, 16)]
)
@pytest.mark.parametrize("fp16", [True, False])
def test_packing_part_by_part_equals_packing_the_whole(bits, group, fp16):
    blocks = random_blocks(16 * 7, 64, bits, group, fp16=fp16)
    pack = {4: pack_int4_tiles, 5: pack_int5_tiles, 6: pack_int6_tiles, 8: pack_byte_tiles}[bits]
    whole = {"weight": pack(blocks.u), "scales_offsets": tile_scales(blocks.scale, blocks.offset)}
    assert whole["scales_offsets"].dtype == (torch.float16 if fp16 else torch.float32)
    for rows in (16, 32, 48, 16 * 7):  # parts of one tile, two, three with a shorter last one, and one part
        parts = BlockLinear(blocks.row_parts(rows))
        for name, buffer in whole.items():
            assert torch.equal(buffer, getattr(parts, name)) and buffer.dtype == getattr(parts, name).dtype


def test_scales_are_fp16_only_where_every_part_is_exact_in_fp16():
    blocks = random_blocks(64, 64, 4, 32, fp16=True)
    blocks.scale[40, 1] = 1 / 3  # one scale fp16 cannot hold, in the third part of 16 rows
    assert BlockLinear(blocks.row_parts(16)).scales_offsets.dtype == torch.float32


def test_row_parts_that_do_not_cover_the_weight_in_whole_tiles_are_an_error():
    blocks = random_blocks(64, 64, 4, 32)
    short = blocks.row_parts(16)
    short.shape = torch.Size((80, 64))
    with pytest.raises(ValueError, match="cover 64 of the weight's 80 rows"):
        BlockLinear(short)
    long = blocks.row_parts(16)
    long.shape = torch.Size((48, 64))
    with pytest.raises(ValueError, match="within the weight's 48"):
        BlockLinear(long)
    with pytest.raises(ValueError, match="rows in 16s"):
        blocks.row_parts(24)
    mixed = random_blocks(64, 64, 8, 32).row_parts(16)
    mixed.group_size = 16
    with pytest.raises(ValueError, match="groups of 32 in a weight of 8-bit values in groups of 16"):
        BlockLinear(mixed)


def test_groups_other_than_16_or_32_have_no_kernel():
    with pytest.raises(ValueError, match="no kernel"):
        BlockLinear(random_blocks(16, 128, 4, 64))


@pytest.mark.parametrize("bits", [5, 6])
@pytest.mark.parametrize("group", [32, 16])
def test_five_and_six_bit_values_pack_into_that_many_bits_a_weight(bits, group):
    blocks = random_blocks(32, 128, bits, group)
    assert BlockLinear(blocks).weight.numel() * 8 == bits * 32 * 128
    assert torch.equal(BlockLinear(blocks).dequantize(), blocks.dequantize())


@needs_kernels
@pytest.mark.parametrize(
    ("bits", "group"), [(4, 32), (5, 32), (6, 32), (8, 32), (4, 16), (5, 16), (6, 16), (8, 16)]
)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 33])
@pytest.mark.parametrize("fp16", [False, True])
def test_gemm_equals_the_rounded_activation_oracle(bits, group, rows, fp16):
    torch.manual_seed(rows)
    blocks = random_blocks(64, 256, bits, group, seed=bits + group, fp16=fp16)
    bias = torch.randn(64)
    module = BlockLinear(blocks, bias)
    # scales and offsets fp16 exactly where fp16 holds them all (half their bytes), fp32 otherwise
    assert module.scales_offsets.dtype == (torch.float16 if fp16 else torch.float32)
    assert module.bits_per_weight == bits + (32 if fp16 else 64) / group
    x = torch.randn(rows, 256)
    kernels = kernel_ops.cpu.load()
    float_from = kernels.block_float_gemm_min_rows(64, 256)
    floats = 0 < float_from <= rows  # CPUs without VNNI: a float GEMM on the dequantized weight from here
    inputs = x.double() if floats else round_activations(x).double()
    expected = inputs @ blocks.dequantize().double().T + bias.double()
    got = module(x)
    assert got.dtype == torch.float32
    tolerance = dict(rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    torch.testing.assert_close(got.double(), expected, **tolerance)
    dequantized = kernels.block_dequant(module.weight, module.scales_offsets, 256)  # fused multiply-adds
    torch.testing.assert_close(dequantized, blocks.dequantize(), rtol=1e-6, atol=1e-7)
    if not floats:  # this CPU's SIMD path against the scalar loop
        reference = kernels.block_gemm_reference(x, module.weight, module.scales_offsets) + bias
        torch.testing.assert_close(got, reference, **tolerance)


@pytest.mark.parametrize("fp16", [True, False])
def test_iq4_levels_are_held_as_four_bit_indices(fp16):
    blocks = level_blocks(48, 128, fp16=fp16, formats=("IQ4_NL", "IQ4_XS"))
    module = BlockLinear(blocks)
    assert module.levels and module.bits == 4 and module.weight.dtype == torch.int8
    assert module.weight.numel() * 8 == 4 * 48 * 128
    assert module.bits_per_weight == 4 + (32 if fp16 else 64) / 32
    assert torch.equal(module.dequantize(), blocks.dequantize())
    rows = torch.tensor([0, 17, 47, 17])
    assert torch.equal(module.dequantize_rows(rows), blocks.dequantize()[rows])
    whole = module.weight
    for rows in (16, 32):  # packed part by part: the same bytes
        assert torch.equal(BlockLinear(blocks.row_parts(rows)).weight, whole)


def test_levels_only_for_iq4_formats_and_their_values():
    blocks = level_blocks(32, 64)
    other = random_blocks(32, 64, 8, 32)
    mixed = BlockLinear(BlockWeights.concat([blocks, other]))  # IQ4 with Q8_0 rows: plain bytes, exact
    assert not mixed.levels and mixed.bits == 8
    assert torch.equal(mixed.dequantize(), BlockWeights.concat([blocks, other]).dequantize())
    blocks.u[3, 5] = 2  # not a level
    with pytest.raises(ValueError, match="value 2 is not one of the IQ4 levels"):
        BlockLinear(blocks)


def assert_gemm_matches_the_oracle(
    blocks: BlockWeights, rows: int
) -> tuple[BlockLinear, torch.Tensor, torch.Tensor]:
    """The module of ``blocks`` (with a bias) against the rounded-activation oracle, the dequantized weight, the
    portable loop and the embedding lookup; returns (module, x, its output)."""
    bias = torch.randn(64)
    module = BlockLinear(blocks, bias)
    x = torch.randn(rows, 256)
    kernels = kernel_ops.cpu.load()
    floats = 0 < kernels.block_float_gemm_min_rows(64, 256) <= rows
    inputs = x.double() if floats else round_activations(x).double()
    expected = inputs @ blocks.dequantize().double().T + bias.double()
    got = module(x)
    tolerance = dict(rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    torch.testing.assert_close(got.double(), expected, **tolerance)
    dequantized = kernels.block_dequant(module.weight, module.scales_offsets, 256)
    torch.testing.assert_close(dequantized, blocks.dequantize(), rtol=1e-6, atol=1e-7)
    if not floats:
        reference = kernels.block_gemm_reference(x, module.weight, module.scales_offsets) + bias
        torch.testing.assert_close(got, reference, **tolerance)
    ids = torch.tensor([0, 63, 5])
    assert torch.equal(BlockEmbedding(module, torch.float32)(ids), module.dequantize()[ids])
    return module, x, got


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 33])
def test_level_gemm_equals_the_rounded_activation_oracle(rows):
    torch.manual_seed(rows)
    module, _, _ = assert_gemm_matches_the_oracle(level_blocks(64, 256, seed=rows, fp16=rows % 2 == 0), rows)
    assert module.levels and module.scales_offsets.shape[2] == 2


# (bits, group, center): Q4_0, Q5_0, Q8_0, Q6_K, Q3_K (nibbles moved from 4 to center 8), and bytes moved to center
# 128 (a fused weight of Q6_K and Q3_K parts)
SYMMETRIC = [(4, 32, 8), (5, 32, 16), (8, 32, 128), (6, 16, 32), (4, 16, 4), (8, 16, 32), (8, 16, 4)]


@pytest.mark.parametrize(("bits", "group", "center"), SYMMETRIC)
def test_symmetric_weights_keep_their_scales_alone(bits, group, center):
    blocks = random_blocks(48, 128, bits, group, fp16=True, center=center)
    module = BlockLinear(blocks)
    assert module.scales_offsets.shape[2] == 1 and module.scales_offsets.dtype == torch.float16
    assert module.bits_per_weight == bits + 16 / group
    assert torch.equal(module.dequantize(), blocks.dequantize())
    rows = torch.tensor([0, 17, 47, 17])
    assert torch.equal(module.dequantize_rows(rows), blocks.dequantize()[rows])
    assert torch.equal(BlockLinear(blocks.row_parts(16)).weight, module.weight)


def test_scales_alone_only_where_every_offset_is_minus_center_times_scale():
    blocks = random_blocks(32, 64, 4, 32, center=8)
    other = random_blocks(32, 64, 4, 32)
    assert BlockLinear(BlockWeights.concat([blocks, other])).scales_offsets.shape[2] == 2
    below_the_middle = random_blocks(32, 64, 4, 32, center=4)  # values 0 .. 7, moved up to sit around 8
    assert BlockLinear(below_the_middle).scales_offsets.shape[2] == 1
    blocks.offset[3, 1] *= 1.5
    with pytest.raises(ValueError, match="not -8 x scale"):
        BlockLinear(blocks)


@needs_kernels
@pytest.mark.parametrize(("bits", "group", "center"), [*SYMMETRIC, ("levels", 32, 128)])
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_symmetric_gemm_equals_the_rounded_activation_oracle(bits, group, center, rows):
    torch.manual_seed(rows)
    if bits == "levels":
        blocks = level_blocks(64, 256, seed=rows)
        blocks.center = 128
    else:
        blocks = random_blocks(64, 256, bits, group, seed=rows, center=center)
    module, x, got = assert_gemm_matches_the_oracle(blocks, rows)
    assert module.scales_offsets.shape[2] == 1
    # the offsets the kernels derive are the ones they would have read: the same bits as with both kept, where
    # the values stay where they are (bytes moved to center 128 change the float sums' rounding only)
    both = BlockLinear(dataclasses.replace(blocks, center=None), module.bias)
    assert both.scales_offsets.shape[2] == 2
    if center == value_center(module.bits, module.levels):  # values not moved
        assert torch.equal(both(x), got)
    else:
        torch.testing.assert_close(both(x), got, rtol=1e-6, atol=1e-6 * got.abs().max().item())


@needs_kernels
def test_bf16_input_gives_bf16_output_of_the_same_sums():
    module = BlockLinear(random_blocks(32, 64, 8, 32))
    x = torch.randn(2, 64).to(torch.bfloat16)
    assert module(x).dtype == torch.bfloat16
    torch.testing.assert_close(module(x).float(), module(x.float()).bfloat16().float())


@needs_kernels
@pytest.mark.parametrize(
    ("bits", "group"), [(4, 32), (5, 32), (6, 32), (8, 32), (4, 16), (5, 16), (6, 16), (8, 16)]
)
@pytest.mark.parametrize("rows", [1, 5])
def test_bf16_output_is_the_fp32_output_rounded_to_nearest_even(bits, group, rows):
    """The kernels round bf16 results themselves: bit for bit what converting their fp32 results gives (rows
    from 1e-3 to 1e3 in size)."""
    kernels = kernel_ops.cpu.load()
    module = BlockLinear(random_blocks(48, 128, bits, group, seed=bits + group, fp16=True))
    x = (torch.randn(rows, 128) * torch.logspace(-3, 3, rows).unsqueeze(1)).bfloat16()
    got = kernels.block_gemm(x, module.weight, module.scales_offsets)
    expected = kernels.block_gemm(x.float(), module.weight, module.scales_offsets).bfloat16()
    assert got.dtype == torch.bfloat16
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))


@needs_kernels
def test_a_bias_is_added_before_the_bf16_rounding():
    blocks = random_blocks(32, 64, 4, 32)
    bias = torch.randn(32) * 0.01
    module = BlockLinear(blocks, bias)
    x = torch.randn(3, 64).bfloat16()
    expected = (BlockLinear(blocks)(x.float()) + bias).bfloat16()
    assert torch.equal(module(x), expected)


def test_concat_of_mixed_formats_is_exact():
    a, b = random_blocks(32, 64, 4, 32, seed=1), random_blocks(16, 64, 8, 16, seed=2)
    both = BlockWeights.concat([a, b])
    assert (both.bits, both.group_size, both.formats) == (8, 16, ("test4", "test8"))
    assert torch.equal(both.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))


def test_scaled_and_rows():
    a = random_blocks(32, 64, 4, 32)
    index = torch.arange(31, -1, -1)
    assert torch.equal(a.rows(index).dequantize(), a.dequantize()[index])
    torch.testing.assert_close(a.scaled(0.125).dequantize(), a.dequantize() * 0.125)


@pytest.mark.parametrize(
    ("bits", "group"), [(4, 32), (5, 32), (6, 32), (8, 32), (4, 16), (5, 16), (6, 16), (8, 16)]
)
def test_embedding_reads_the_table_rows(bits, group):
    """The compiled lookup gives dequantize_rows's values bit for bit (the product rounded before the add)."""
    table = BlockLinear(random_blocks(48, 64, bits, group))
    embedding = BlockEmbedding(table, torch.float32)
    ids = torch.tensor([[3, 0], [47, 3]])
    assert torch.equal(embedding(ids), table.dequantize()[ids])
    assert torch.equal(embedding(ids.int()), embedding(ids))
    for bad in (48, -1):
        with pytest.raises(IndexError, match="out of range for a 48-token vocabulary"):
            embedding(torch.tensor([bad]))


def test_kernels_unavailable_says_why(monkeypatch):
    monkeypatch.setattr(kernel_ops.cpu, "load", lambda: None)
    monkeypatch.setattr(kernel_ops.cpu, "unavailable_reason", lambda: "disabled by MCP2026_KERNELS=0")
    assert "MCP2026_KERNELS=0" in kernels_unavailable()
