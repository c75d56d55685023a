"""The int8 GEMM (kernels/int8_gemm.cpp, AVX-512 VNNI builds): activations in two int8 planes per 32 values
against per-channel int8 weights, checked against the same arithmetic written out in float64 and against the
float product; a row's bits independent of the batch;
the layers that route to it (every row count) and the shapes that cannot."""

from __future__ import annotations

import pytest
import torch

from mcp2026.quant.int8_linear import Int8Linear
from mcp2026.quant.plan import LayerQuantSpec


def layer(k: int, n: int, bias: bool = False) -> Int8Linear:
    torch.manual_seed(k + n)
    return Int8Linear.from_linear(torch.nn.Linear(k, n, bias=bias), LayerQuantSpec("int8"), torch.float32)


def reference(x: torch.Tensor, q: Int8Linear) -> torch.Tensor:
    """The kernel's arithmetic written out: per 32 values, t = x / (amax / 127) in fp32, q1 = round(t) and
    q2 = round(256 (t - q1)) (rounding half to even, as the kernel's conversions), the integer dots of the
    weights with 256 q1 + q2 scaled by amax / 127 / 256 and by the column's weight scale; in float64."""
    rows, k = x.shape
    blocks = x.float().reshape(rows, k // 32, 32)
    dx = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(dx > 0, 1 / dx, torch.zeros_like(dx))
    t = blocks * inv
    q1 = torch.round(t)
    q2 = torch.round((t - q1) * 256).clamp(-127, 127)
    c = (256 * q1 + q2).double()
    w = q.weight.double().reshape(q.out_features, k // 32, 32)
    dots = torch.einsum("rbk,nbk->rnb", c, w)
    return (dots * (dx.double() / 256).squeeze(-1)[:, None, :]).sum(-1) * q.scales.double()


# n: tiles of 16 in pairs and a last single tile (48); k: 1 .. 48 blocks; rows: partial and full 4-row tiles
@pytest.mark.parametrize(("k", "n"), [(32, 16), (96, 48), (576, 960), (1536, 80)])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16, 37])
def test_gemm_is_per_block_int8_arithmetic(gemm, k, n, rows):
    q = layer(k, n)
    x = torch.randn(rows, k)
    y = gemm.int8_gemm(x, q.gemm_weights(), q.gemv_scales())
    torch.testing.assert_close(y.double(), reference(x, q), atol=1e-4, rtol=1e-4)
    exact = x @ q.dequantize().T
    assert ((y - exact).norm() / exact.norm()).item() < 1e-4  # two int8 planes: ~2e-5


def test_gemm_gives_a_row_the_same_bits_in_any_batch(gemm):
    q = layer(576, 96)
    x = torch.randn(23, 576)
    batched = gemm.int8_gemm(x, q.gemm_weights(), q.gemv_scales())
    for i in range(23):
        assert torch.equal(
            gemm.int8_gemm(x[i : i + 1], q.gemm_weights(), q.gemv_scales()), batched[i : i + 1]
        )


def test_bf16_activations_and_bad_operands(gemm):
    q = layer(64, 32)
    wp, scales = q.gemm_weights(), q.gemv_scales()
    x = torch.randn(6, 64)
    y = gemm.int8_gemm(x.bfloat16(), wp, scales)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(
        y.float(), gemm.int8_gemm(x.bfloat16().float(), wp, scales), atol=2e-2, rtol=2e-2
    )
    with pytest.raises(RuntimeError, match="wp must be"):
        gemm.int8_gemm(torch.randn(6, 96), wp, scales)  # another K
    with pytest.raises(RuntimeError, match="scales must be"):
        gemm.int8_gemm(x, wp, scales[:16])
    with pytest.raises(RuntimeError, match="N % 16 == 0 and K % 32 == 0"):
        gemm.int8_gemm_pack(torch.zeros(24, 64, dtype=torch.int8))


def test_int8_layers_take_the_gemm_at_every_row_count(gemm, gemm_calls):
    q = layer(128, 64, bias=True)
    with torch.inference_mode():
        for rows in (1, 9, 20, 300):
            x = torch.randn(rows, 128)
            torch.testing.assert_close(q(x), gemm.int8_gemm(x, q.gemm_weights(), q.gemv_scales()) + q.bias)
    assert gemm_calls == [("int8_gemm", rows) for rows in (1, 9, 20, 300)]
    q.load_state_dict(q.state_dict())
    assert "_gemm" not in q.__dict__  # new weights: the layout is rebuilt on next use


def test_a_layer_the_tiles_do_not_fit_takes_the_other_kernels(gemm, gemm_calls):
    for k, n in ((48, 32), (64, 24)):  # K not in 32-blocks; N not in 16-column tiles
        q = layer(k, n)
        assert not q.gemm_shape_ok()
        x = torch.randn(5, k)
        with torch.inference_mode():
            y = q(x)
        torch.testing.assert_close(y, x @ q.dequantize().T, atol=1e-4, rtol=1e-4)  # float activations
    assert gemm_calls == []


def test_the_fused_decode_layer_runs_the_gemm_as_the_module_does(gemm):
    from mcp2026.models.fused_linear import INT8_GEMM, fused_linear

    q = layer(128, 64, bias=True)
    handle = fused_linear(gemm, q, quant_rows=True)
    assert q.__dict__["_fused"].value[0] == INT8_GEMM
    x = torch.randn(2, 128)
    with torch.inference_mode():
        assert torch.equal(handle(x), q(x))
