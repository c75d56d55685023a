"""The int4 GEMM (kernels/int4_gemm.cpp, AVX-512 VNNI builds): the GEMV's arithmetic (same int8 activations,
same weights) at any row count, a row's bits independent of the batch, and the layers that route to it."""

from __future__ import annotations

import pytest
import torch

from mcp2026.quant.int4_linear import Int4Linear
from mcp2026.quant.plan import LayerQuantSpec


def layer(k: int, n: int, group_size: int = 32, symmetric: bool = False, bias: bool = False) -> Int4Linear:
    torch.manual_seed(k + n)
    spec = LayerQuantSpec("int4", group_size=group_size, symmetric=symmetric)
    return Int4Linear.from_linear(torch.nn.Linear(k, n, bias=bias), spec, torch.float32)


# n: tiles of 16 in pairs and a last single tile (48); k: 2 .. 48 blocks; rows: partial and full 4-row tiles
@pytest.mark.parametrize(
    ("k", "n", "group_size"), [(64, 32, 32), (96, 48, 32), (576, 960, 64), (1536, 80, 128)]
)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16, 37])
def test_gemm_is_the_gemvs_arithmetic(gemm, k, n, group_size, rows):
    q = layer(k, n, group_size)
    qs, sz = q.gemv_weights()
    wp, so = gemm.int4_gemm_pack(qs, sz)
    x = torch.randn(rows, k)
    y = gemm.int4_gemm(x, wp, so)
    # the same int32 dot per 32-block and the same scaling: only the float summation order differs
    torch.testing.assert_close(y, gemm.int4_gemv(x, qs, sz), atol=1e-5, rtol=1e-5)
    exact = x @ q.dequantize().T
    assert ((y - exact).norm() / exact.norm()).item() < 0.01  # int8 activations: ~0.5%


def test_gemm_gives_a_row_the_same_bits_in_any_batch(gemm):
    q = layer(576, 96)
    wp, so = q.gemm_weights()
    x = torch.randn(23, 576)
    batched = gemm.int4_gemm(x, wp, so)
    for i in range(23):
        assert torch.equal(gemm.int4_gemm(x[i : i + 1], wp, so), batched[i : i + 1])
    assert torch.equal(gemm.int4_gemm(x[5:18], wp, so), batched[5:18])


def test_bf16_activations_and_bad_operands(gemm):
    q = layer(64, 32)
    wp, so = q.gemm_weights()
    x = torch.randn(6, 64)
    y = gemm.int4_gemm(x.bfloat16(), wp, so)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), gemm.int4_gemm(x.bfloat16().float(), wp, so), atol=2e-2, rtol=2e-2)
    with pytest.raises(RuntimeError, match="wp must be"):
        gemm.int4_gemm(torch.randn(6, 96), wp, so)  # another K
    with pytest.raises(RuntimeError, match="N must be a multiple of 16"):
        qs, sz = torch.zeros(24, 2, 16, dtype=torch.uint8), torch.zeros(24, 2, 2, dtype=torch.float16)
        gemm.int4_gemm_pack(qs, sz)


def test_int4_layers_take_the_gemm_at_every_row_count(gemm, gemm_calls):
    q = layer(128, 64, bias=True)
    with torch.inference_mode():
        for rows in (1, 9, 20, 300):
            x = torch.randn(rows, 128)
            y = q(x)
            wp, so = q.gemm_weights()
            torch.testing.assert_close(y, gemm.int4_gemm(x, wp, so) + q.bias)
    assert gemm_calls == [("int4_gemm", rows) for rows in (1, 9, 20, 300)]
    assert "_gemm" in q.__dict__ and "_gemv" not in q.__dict__  # the GEMV layout is not kept beside it
    q.load_state_dict(q.state_dict())
    assert "_gemm" not in q.__dict__  # new weights: the layout is rebuilt on next use


def test_an_activation_scaled_layer_divides_before_the_gemm(gemm):
    torch.manual_seed(4)
    act_scale = torch.rand(64) + 0.5
    spec = LayerQuantSpec("int4", act_scale="awq")
    q = Int4Linear.from_linear(torch.nn.Linear(64, 32, bias=False), spec, torch.float32, act_scale=act_scale)
    x = torch.randn(3, 64)
    with torch.inference_mode():
        y = q(x)
    exact = x @ q.dequantize().T
    assert ((y - exact).norm() / exact.norm()).item() < 0.02


def test_the_fused_decode_layer_runs_the_gemm_as_the_module_does(gemm):
    from mcp2026.models.fused_linear import INT4_GEMM, fused_linear

    q = layer(128, 64, bias=True)
    handle = fused_linear(gemm, q, quant_rows=True)
    assert q.__dict__["_fused"].value[0] == INT4_GEMM
    x = torch.randn(2, 128)
    with torch.inference_mode():
        assert torch.equal(handle(x), q(x))
