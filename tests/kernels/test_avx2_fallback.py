"""The kernels as a CPU with AVX2 and no AVX-512 runs them: the sources built for Haswell (the AVX2 paths, not the
VNNI ones this test machine would pick), held against the portable loops and torch. One build for the module
(about two minutes on two cores)."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from mcp2026 import hardware
from mcp2026.kernels import cpu
from mcp2026.quant.block_linear import LEVEL_VALUES, BlockLinear, BlockWeights
from super_block_weights import super_block_weights


@pytest.fixture(scope="module")
def avx2():
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler")
    from torch.utils import cpp_extension

    build_dir = hardware.cache_dir() / "kernels-haswell-test" / cpu.build_key()
    build_dir.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load(
        name=f"mcp2026_cpu_haswell_{cpu.build_key()}",
        sources=[str(path) for path in cpu.SOURCES],
        extra_cflags=["-O3", "-march=haswell", "-fopenmp", "-ffp-contract=fast"],
        extra_ldflags=["-fopenmp"],
        build_directory=str(build_dir),
    )


def test_the_build_has_no_vnni_path(avx2):
    assert not avx2.vnni_gemm_available()


def assert_matches_the_portable_loop(avx2, linear: BlockLinear, rows: int) -> None:
    """The AVX2 GEMM against the portable loop (from 32 rows: the float GEMM on the dequantized weight), and
    the row lookup against the dequantized weight."""
    k = linear.in_features
    x = torch.randn(rows, k)
    y = avx2.block_gemm(x, linear.weight, linear.scales_offsets)
    if rows >= 32:
        expected = x @ linear.dequantize().T
    else:
        expected = avx2.block_gemm_reference(x, linear.weight, linear.scales_offsets)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-4 * expected.abs().max().item())
    ids = torch.tensor([0, 17, 63])
    torch.testing.assert_close(
        avx2.block_weight_rows(linear.weight, linear.scales_offsets, k, ids), linear.dequantize()[ids]
    )


@pytest.mark.parametrize(
    ("bits", "group"), [(4, 32), (5, 32), (6, 32), (8, 32), (4, 16), (5, 16), (6, 16), (8, 16)]
)
@pytest.mark.parametrize("rows", [1, 3, 5, 40])  # 40: the float GEMM on the dequantized weight
@pytest.mark.parametrize("symmetric", [False, True])  # True: the scales alone (offsets -center x scale)
def test_block_gemm_matches_the_portable_loop(avx2, bits, group, rows, symmetric):
    torch.manual_seed(bits + group + rows)
    n, k = 64, 256
    u = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8)
    scale = torch.rand(n, k // group) + 0.5
    center = 2 ** (bits - 1)
    offset = -center * scale * (1 if symmetric else 1 + 0.1 * torch.randn(n, k // group))
    linear = BlockLinear(
        BlockWeights(u, scale, offset, group, bits, ("test",), center if symmetric else None)
    )
    assert linear.scales_offsets.shape[2] == (1 if symmetric else 2)
    assert_matches_the_portable_loop(avx2, linear, rows)


@pytest.mark.parametrize("rows", [1, 3, 5, 40])
@pytest.mark.parametrize("symmetric", [False, True])
def test_block_gemm_of_iq4_levels_matches_the_portable_loop(avx2, rows, symmetric):
    torch.manual_seed(rows)
    n, k = 64, 256
    u = torch.tensor(LEVEL_VALUES, dtype=torch.uint8)[torch.randint(0, 16, (n, k))]
    scale = torch.rand(n, k // 32) + 0.5
    center = 128 if symmetric else None
    linear = BlockLinear(BlockWeights(u, scale, -128 * scale, 32, 8, ("IQ4_NL",), center))
    assert linear.weight.dtype == torch.int8
    assert_matches_the_portable_loop(avx2, linear, rows)


@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize(
    ("bits", "group", "center"), [(4, 32, None), (5, 32, None), (6, 16, 32), (4, 16, 4), ("levels", 32, 128)]
)
def test_block_gemm_with_super_block_scales_matches_the_portable_loop(avx2, rows, bits, group, center):
    """The K-quants' scales as stored (a factor per 256 weights, an integer per group): the AVX2 GEMM, the
    dequantizer and the row lookup read them (Q4_K, Q5_K, Q6_K, IQ4_XS)."""
    torch.manual_seed(rows)
    linear = BlockLinear(super_block_weights(64, 512, bits, group, center, seed=rows))
    assert linear.scales_offsets.dtype == torch.int8
    assert_matches_the_portable_loop(avx2, linear, rows)


def test_gated_activations_and_head_norms_match_torch(avx2):
    torch.manual_seed(0)
    gate_up = torch.randn(3, 2 * 40) * 3
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(avx2.silu_mul(gate_up, torch.float32), F.silu(gate) * up, rtol=1e-5, atol=1e-5)
    expected = F.gelu(gate, approximate="tanh") * up
    torch.testing.assert_close(avx2.gelu_tanh_mul(gate_up, torch.float32), expected, rtol=1e-5, atol=1e-5)
    qk, qw, kw = torch.randn(2, 5, 16), torch.rand(16), torch.rand(16)
    expected = torch.cat(
        (F.rms_norm(qk[:, :3], (16,), qw, 1e-6), F.rms_norm(qk[:, 3:], (16,), kw, 1e-6)), dim=1
    )
    avx2.rms_norm_heads_(qk, qw, kw, 3, 1e-6)
    torch.testing.assert_close(qk, expected, rtol=1e-5, atol=1e-5)


def test_paged_decode_attention_from_window_starts(avx2):
    torch.manual_seed(1)
    num_blocks, nkv, bs, nh, hd = 30, 2, 16, 4, 32
    k_cache, v_cache = torch.randn(num_blocks, nkv, bs, hd), torch.randn(num_blocks, nkv, bs, hd)
    q = torch.randn(2, nh, hd) / hd**0.5
    tables = torch.randperm(num_blocks)[:10].view(2, 5)
    lengths, starts = torch.tensor([70, 33]), torch.tensor([37, 0])
    out = avx2.paged_decode_attention(q, k_cache, v_cache, tables, lengths, None, starts)
    for b in range(2):
        blocks = tables[b]
        k = k_cache[blocks].transpose(0, 1).flatten(1, 2)[:, starts[b] : lengths[b]]
        v = v_cache[blocks].transpose(0, 1).flatten(1, 2)[:, starts[b] : lengths[b]]
        ref = F.scaled_dot_product_attention(
            q[b][None, :, None], k[None], v[None], scale=1.0, enable_gqa=True
        )
        torch.testing.assert_close(out[b], ref[0, :, 0], rtol=1e-4, atol=1e-4)
