"""Paged decode attention on the GPU (Triton): one query token per sequence over its KV blocks, read in place
through the block table.

The blocks of a layer are (num_blocks, nkv, bs, hd) in the cache's float dtype. A sequence's tokens are
split into ``num_splits`` contiguous ranges (split-K), so a batch of one still spreads its context over many
programs; each program handles one (sequence, KV head, range) for all query heads of that KV head at once
(the KV head's keys are read once for its whole group), keeping an online softmax. A second kernel merges
the ranges by their log-sum-exps. Both grids depend only on the batch size, never on the lengths, so a
CUDA graph captured once replays for any lengths up to the table's width.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

# Tokens each program reads per iteration (several pages: page ids are looked up per token).
BLOCK_N = 64
MAX_SPLITS = 16


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, lengths_ptr, acc_ptr, ml_ptr,
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_kt,
    stride_tb,
    stride_ab, stride_ah, stride_as,
    stride_mb, stride_mh, stride_ms,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK: tl.constexpr, NUM_SPLITS: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(lengths_ptr + b).to(tl.int32)
    per_split = tl.cdiv(tl.cdiv(length, NUM_SPLITS), BLOCK) * BLOCK
    start = split * per_split
    end = tl.minimum(start + per_split, length)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    heads = kvh * GROUP + g
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=(g < GROUP)[:, None], other=0.0
    )
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    den = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for t0 in range(start, end, BLOCK):
        t = t0 + tl.arange(0, BLOCK)
        live = t < end
        page = tl.load(tables_ptr + b * stride_tb + t // PAGE, mask=live, other=0)
        rows = page.to(tl.int64) * stride_kb + kvh * stride_kh + (t % PAGE) * stride_kt
        k = tl.load(k_ptr + rows[:, None] + d[None, :], mask=live[:, None], other=0.0)
        if IEEE:
            s = tl.dot(q.to(k.dtype), tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q.to(k.dtype), tl.trans(k))
        s = tl.where(live[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        den = den * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + rows[:, None] + d[None, :], mask=live[:, None], other=0.0)
        if IEEE:  # noqa: SIM108 - a constexpr branch: Triton compiles only the taken one
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m = m_new
    out_rows = b * stride_ab + heads * stride_ah + split * stride_as
    tl.store(acc_ptr + out_rows[:, None] + d[None, :], acc, mask=(g < GROUP)[:, None])
    ml_rows = b * stride_mb + heads * stride_mh + split * stride_ms
    tl.store(ml_ptr + ml_rows, m, mask=g < GROUP)
    tl.store(ml_ptr + ml_rows + 1, den, mask=g < GROUP)


@triton.jit
def _decode_merge_kernel(
    acc_ptr, ml_ptr, out_ptr,
    stride_ab, stride_ah, stride_as,
    stride_mb, stride_mh, stride_ms,
    stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM)
    used = s < NUM_SPLITS
    ml = ml_ptr + b * stride_mb + h * stride_mh + s * stride_ms
    m = tl.load(ml, mask=used, other=float("-inf"))
    den = tl.load(ml + 1, mask=used, other=0.0)
    top = tl.max(m, 0)  # finite: the first range of every sequence holds at least one token
    w = tl.where(used & (m > float("-inf")), tl.exp(m - top), 0.0)
    acc = tl.load(
        acc_ptr + b * stride_ab + h * stride_ah + s[:, None] * stride_as + d[None, :],
        mask=used[:, None],
        other=0.0,
    )
    out = tl.sum(acc * w[:, None], 0) / tl.sum(den * w, 0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty))


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def num_splits(batch: int, num_kv_heads: int, num_sms: int) -> int:
    """Ranges per sequence: enough programs to cover the GPU's ``num_sms`` multiprocessors about twice at small
    batches, one range per sequence once the batch alone fills them."""
    want = -(-2 * num_sms // max(batch * num_kv_heads, 1))
    return max(1, min(MAX_SPLITS, triton.next_power_of_2(want)))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    splits: int | None = None,
) -> torch.Tensor:
    """q (B, nh, hd) pre-scaled; caches (num_blocks, nkv, bs, hd); tables (B, nb) block ids; lengths (B,) >= 1
    tokens to attend. Returns (B, nh, hd) in q's dtype. Accumulates in fp32; fp32 caches multiply in IEEE fp32
    (not TF32), so an fp32 model stays exact."""
    batch, num_heads, head_dim = q.shape
    _, num_kv_heads, page, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim or head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"head_dim {head_dim} unsupported by the GPU decode kernel (a power of two >= 16)")
    if k_cache.stride(-1) != 1 or q.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("the GPU decode kernel needs the last dimension contiguous, K and V laid out alike")
    group = num_heads // num_kv_heads
    splits = splits or num_splits(batch, num_kv_heads, _multiprocessors(q.device))
    acc = torch.empty(batch, num_heads, splits, head_dim, device=q.device, dtype=torch.float32)
    ml = torch.empty(batch, num_heads, splits, 2, device=q.device, dtype=torch.float32)
    _decode_split_kernel[(batch, num_kv_heads, splits)](
        q, k_cache, v_cache, tables, lengths, acc, ml,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        tables.stride(0),
        acc.stride(0), acc.stride(1), acc.stride(2),
        ml.stride(0), ml.stride(1), ml.stride(2),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, PAGE=page,
        BLOCK=BLOCK_N, NUM_SPLITS=splits, IEEE=k_cache.dtype == torch.float32,
    )  # fmt: skip
    out = torch.empty_like(q)
    _decode_merge_kernel[(batch, num_heads)](
        acc, ml, out,
        acc.stride(0), acc.stride(1), acc.stride(2),
        ml.stride(0), ml.stride(1), ml.stride(2),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, NUM_SPLITS=splits, SPLITS_PAD=max(2, triton.next_power_of_2(splits)),
    )  # fmt: skip
    return out
