"""Int8 weight-only matmul on the GPU (Triton): y = (x @ q.T) * scales, q int8 (N, K) per output channel.

Each tile of q is widened to the activation dtype in registers right after it is loaded, so the weights
cross memory once, at one byte each: at decode sizes, where a linear is bound by reading its weights, that
is half the bytes of bf16. Accumulates in fp32; scales apply once per output column.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _int8_matmul_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        x = tl.load(
            x_ptr + rm[:, None] * stride_xm + kk[None, :],
            mask=(rm < M)[:, None] & (kk < K)[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + rn[None, :] * stride_wn + kk[:, None], mask=(rn < N)[None, :] & (kk < K)[:, None], other=0
        )
        if IEEE:
            acc += tl.dot(x, w.to(x.dtype), input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    s = tl.load(s_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    y = acc * s[None, :]
    tl.store(
        y_ptr + rm[:, None] * stride_ym + rn[None, :],
        y.to(y_ptr.dtype.element_ty),
        mask=(rm < M)[:, None] & (rn < N)[None, :],
    )


def int8_matmul(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x (M, K) float, weight (N, K) int8, scales (N,) -> (M, N) in x's dtype."""
    m, k = x.shape
    n = weight.shape[0]
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("int8_matmul needs row-major x and weight")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else 64
    block_n = 32 if n <= 4096 else 64  # small layers: more programs to spread the weight reads
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    _int8_matmul_kernel[grid](
        x, weight, scales, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=64, IEEE=x.dtype == torch.float32,
    )  # fmt: skip
    return y
