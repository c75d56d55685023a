"""A decoder layer's elementwise chains as one GPU kernel each (Triton): residual add + RMSNorm, SiLU * up,
rotary embedding in place, and the K/V write into the paged cache.

At decode sizes a layer's time on the GPU is launch count, not arithmetic: torch runs RMSNorm, the rotation
and a strided K/V copy as several kernels each. These compute what the torch ops in ``kernels.ops`` compute
(fp32 inside, one rounding to the tensor's dtype at the end), in one launch each.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(
    res_ptr, x_ptr, w_ptr, out_ptr, n, eps, stride_r, stride_x, stride_o,
    HAS_X: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
    if HAS_X:
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        r = (r.to(tl.float32) + x.to(tl.float32)).to(r.dtype)  # the stream keeps its dtype, as torch's add
        tl.store(res_ptr + row * stride_r + cols, r, mask=mask)
    h = r.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(h * h, 0) / n + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (h * inv * w).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(
    residual: torch.Tensor, x: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """residual <- residual + x in place (x None: unchanged); returns RMSNorm(residual) * weight (T, H)."""
    rows, n = residual.shape
    out = torch.empty_like(residual)
    _add_rms_norm_kernel[(rows,)](
        residual, residual if x is None else x, weight, out, n, eps,
        residual.stride(0), 0 if x is None else x.stride(0), out.stride(0),
        HAS_X=x is not None, BLOCK=triton.next_power_of_2(n),
    )  # fmt: skip
    return out


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, n, stride_g, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(gu_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * stride_g + n + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[gate | up] (T, 2I) -> SiLU(gate) * up (T, I)."""
    rows, width = gate_up.shape
    n = width // 2
    out = torch.empty(rows, n, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(n, block))](
        gate_up, out, n, gate_up.stride(0), out.stride(0), BLOCK=block
    )
    return out


@triton.jit
def _rope_kernel(
    x_ptr, cos_ptr, sin_ptr, stride_xt, stride_xh, stride_ct, stride_st, HALF: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK)
    m = d < HALF  # HALF need not be a power of two (head_dim 96, partial rotary)
    base = x_ptr + t * stride_xt + h * stride_xh
    x1 = tl.load(base + d, mask=m).to(tl.float32)
    x2 = tl.load(base + HALF + d, mask=m).to(tl.float32)
    c1 = tl.load(cos_ptr + t * stride_ct + d, mask=m).to(tl.float32)
    c2 = tl.load(cos_ptr + t * stride_ct + HALF + d, mask=m).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_st + d, mask=m).to(tl.float32)
    s2 = tl.load(sin_ptr + t * stride_st + HALF + d, mask=m).to(tl.float32)
    tl.store(base + d, (x1 * c1 - x2 * s1).to(x_ptr.dtype.element_ty), mask=m)
    tl.store(base + HALF + d, (x2 * c2 + x1 * s2).to(x_ptr.dtype.element_ty), mask=m)


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (T, heads, hd) in place (rotate-half convention) by cos/sin (T, 1, rot); returns x. With rot < hd
    (partial rotary) only each head's first rot dims rotate."""
    tokens, heads, head_dim = x.shape
    rot = cos.shape[-1]
    if x.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("rope_ needs the head dimension contiguous")
    if rot % 2 or rot > head_dim:
        raise ValueError(f"rope_ rotates an even number of dims up to head_dim {head_dim}, got {rot}")
    _rope_kernel[(tokens, heads)](
        x, cos, sin, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0), HALF=rot // 2,
        BLOCK=triton.next_power_of_2(rot // 2),
    )  # fmt: skip
    return x


@triton.jit
def _write_kv_kernel(
    k_rows_ptr, v_rows_ptr, rows_ptr, k_ptr, v_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)  # (token, head)
    t = i // NUM_KV_HEADS
    h = i % NUM_KV_HEADS
    d = tl.arange(0, HEAD_DIM)
    row = tl.load(rows_ptr + i).to(tl.int64)
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d)
    tl.store(k_rows_ptr + row * HEAD_DIM + d, k.to(k_rows_ptr.dtype.element_ty))
    tl.store(v_rows_ptr + row * HEAD_DIM + d, v.to(v_rows_ptr.dtype.element_ty))


def write_kv_rows(
    k_rows: torch.Tensor, v_rows: torch.Tensor, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """k_rows[rows[i]] = k[i // nkv, i % nkv] (and V alike), narrowed to the cache's dtype: k, v (T, nkv, hd)
    with any token and head strides; k_rows, v_rows (R, hd) contiguous; rows (T * nkv,)."""
    tokens, num_kv_heads, head_dim = k.shape
    if k.stride(-1) != 1 or v.stride(-1) != 1 or not (k_rows.is_contiguous() and v_rows.is_contiguous()):
        raise ValueError("write_kv_rows needs contiguous head dimensions and contiguous cache rows")
    if rows.numel() != tokens * num_kv_heads:
        raise ValueError(f"{rows.numel()} rows for {tokens} tokens x {num_kv_heads} KV heads")
    _write_kv_kernel[(rows.numel(),)](
        k_rows, v_rows, rows, k, v, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
    )  # fmt: skip
