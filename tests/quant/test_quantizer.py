"""The quantization math: faithful re-quantization of llama.cpp's grids and the per-group grid search."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import quants

from mcp2026.quant.plan import LayerQuantSpec
from mcp2026.quant.quantizer import (
    code_grids,
    decode_grids,
    dequantize_groupwise_int4,
    fake_quantize,
    grid_codes,
    grid_exponents,
    quantize_groupwise_int4,
    search_groupwise_int4,
)


def _q4_1_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's Q4_1 of ``w`` (N, K): the dequantized weights and the levels 0..15 it stored (N, K)."""
    qtype = gguf.GGMLQuantizationType.Q4_1
    raw = quants.quantize(w.numpy(), qtype)  # per block of 32: d fp16, m fp16, 16 bytes of nibbles
    n, k = w.shape
    nibbles = torch.from_numpy(raw.reshape(n, k // 32, 20)[..., 4:].copy())  # (N, K/32, 16)
    levels = torch.cat([nibbles & 0xF, nibbles >> 4], dim=-1).reshape(n, k)  # byte j: elements j, j + 16
    return torch.from_numpy(quants.dequantize(raw, qtype)), levels


def test_q4_1_requantized_to_asymmetric_int4_g32_gives_its_levels_back():
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)) * 0.05
    deq, levels = _q4_1_blocks(w)
    for quantize in (quantize_groupwise_int4, search_groupwise_int4):
        q, scales, zeros = quantize(deq, 32, False)
        assert torch.equal(q.long(), levels.long())
        step = scales.abs().repeat_interleave(32, dim=1)
        # the same levels; scale and zero differ from Q4_1's fp16 ones by their bf16 rounding only
        err = (dequantize_groupwise_int4(q, scales, zeros, 32) - deq).abs()
        assert (err <= 0.1 * step).all()


def _symmetric_absmax_over_7(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """The symmetric int4 this replaced: levels -7..7, scale = absmax / 7 (15 of the 16 levels)."""
    n, k = w.shape
    wg = w.reshape(n, k // group_size, group_size)
    scale = (wg.abs().amax(-1, keepdim=True) / 7).bfloat16().float()
    return (torch.round(wg / scale).clamp(-7, 7) * scale).reshape(n, k)


def test_symmetric_int4_puts_each_groups_peak_on_level_minus_8():
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    q, scales, zeros = quantize_groupwise_int4(w, 32, symmetric=True)
    deq = dequantize_groupwise_int4(q, scales, zeros, 32)
    wg, dg = w.reshape(64, 8, 32), deq.reshape(64, 8, 32)
    peak = wg.abs().argmax(-1, keepdim=True)
    assert (q.reshape(64, 8, 32).gather(-1, peak) == 0).all()
    torch.testing.assert_close(dg.gather(-1, peak), wg.gather(-1, peak), rtol=2**-8, atol=0)
    # 16 levels instead of 15: measured 0.76x the squared error on these Gaussian weights
    old = ((_symmetric_absmax_over_7(w, 32) - w) ** 2).mean()
    assert ((deq - w) ** 2).mean() < 0.85 * old


@pytest.mark.parametrize("symmetric", [False, True], ids=["asym", "sym"])
def test_grid_search_never_raises_a_groups_error_and_lowers_the_total(symmetric):
    w = torch.distributions.StudentT(4.0).sample((128, 256)) * 0.02
    plain = dequantize_groupwise_int4(*quantize_groupwise_int4(w, 32, symmetric), 32)
    searched = dequantize_groupwise_int4(*search_groupwise_int4(w, 32, symmetric), 32)
    group_err = lambda d: ((d - w) ** 2).reshape(128, 8, 32).sum(-1)  # noqa: E731
    assert (group_err(searched) <= group_err(plain)).all()
    assert group_err(searched).sum() < 0.95 * group_err(plain).sum()


def test_mse_spec_uses_the_grid_search():
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(2))
    spec = LayerQuantSpec("int4", group_size=32, clip_ratio="mse")
    expected = dequantize_groupwise_int4(*search_groupwise_int4(w, 32, False), 32)
    assert torch.equal(fake_quantize(w, spec), expected)
    assert not np.allclose(expected.numpy(), fake_quantize(w, LayerQuantSpec("int4", group_size=32)).numpy())


# ---- int4 grids in 8 bits ------------------------------------------------------------------------------
def _random_grids(n: int = 64, groups: int = 18, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    scales = torch.exp(torch.randn(n, groups, generator=g)) * 1e-3 * torch.rand(n, 1, generator=g)
    return scales, torch.randn(n, groups, generator=g) * 0.02


def test_8_bit_grids_decode_exactly_to_fp16_values_in_the_codes_ranges():
    scales, zeros = _random_grids()
    zeros[3] = 0.0  # a row of zero zeros
    coded_scales, coded_zeros = code_grids(scales, zeros, grid_exponents(scales, zeros))
    scale_codes, zero_codes, exponents = grid_codes(coded_scales, coded_zeros)
    assert scale_codes.dtype == torch.uint8 and zero_codes.dtype == torch.int8 and exponents.shape == (64, 2)
    assert int(scale_codes.min()) >= 1 and int(zero_codes.abs().max()) <= 127
    assert (scale_codes.amax(-1) >= 128).all()  # each row's largest scale uses the top half of the codes
    decoded = decode_grids(scale_codes, zero_codes, exponents)
    for got, want in zip(decoded, (coded_scales, coded_zeros)):
        assert torch.equal(got, want) and torch.equal(got.half().float(), got)  # exact, and fp16 numbers
    relative = (coded_scales - scales).abs() / scales.amax(-1, keepdim=True)
    # half a step of a peak in the top half of 255 codes; a scale under half a step keeps code 1 (a whole step)
    assert relative[scale_codes > 1].max() <= 1 / 256 and relative.max() <= 1 / 128
    with pytest.raises(ValueError, match="not on 8-bit codes"):
        grid_codes(scales.half().float(), zeros.half().float())


def test_weights_on_an_8_bit_grid_requantize_to_themselves():
    scales, zeros = _random_grids(32, 4, seed=1)
    scales, zeros = code_grids(scales, zeros, grid_exponents(scales, zeros))
    q = torch.randint(0, 16, (32, 4, 32), generator=torch.Generator().manual_seed(2))
    q[..., 0], q[..., 1] = 0, 15  # every group spans the whole range
    w = dequantize_groupwise_int4(q.reshape(32, 128), scales, zeros, 32)
    spec = LayerQuantSpec("int4", 32, scale_bits=8)
    assert torch.equal(fake_quantize(w, spec), w)


def test_a_q4_1_grid_on_8_bit_scales_loses_far_less_than_coarser_groups():
    """The 0.5 bits per weight 8-bit scales save at g32, spent on groups of 64 instead, cost much more on weights
    stored as Q4_1 (SmolLM2's file): the coded grids move each weight by a small part of its step."""
    w = torch.randn(64, 576, generator=torch.Generator().manual_seed(0)) * 0.02
    stored, _ = _q4_1_blocks(w)
    error = lambda spec: (fake_quantize(stored, spec) - stored).pow(2).mean().item()  # noqa: E731
    assert error(LayerQuantSpec("int4", 32)) == 0.0
    coded, g64 = error(LayerQuantSpec("int4", 32, scale_bits=8)), error(LayerQuantSpec("int4", 64))
    assert 0 < coded < 0.05 * g64, (coded, g64)
