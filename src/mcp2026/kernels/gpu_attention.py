"""Paged decode attention on the GPU (Triton): one query token per sequence over its KV blocks, read in place
through the block table.

The blocks of a layer are (num_blocks, nkv, bs, hd): in the cache's float dtype, or quantized per (token, head)
as the int8 and fp8 KV codecs store them (``kv.codecs``: uint8 values with an fp16 scale and zero point, or
float8 e4m3 values with an fp16 scale, the scales (num_blocks, nkv, bs)), decoded in registers as they are
loaded, in float32, so a quantized cache costs no gathered float copy. A sequence's tokens are
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
def _load_rows(x_ptr, s_ptr, z_ptr, rows, srows, d, live, KIND: tl.constexpr):
    """(BLOCK, HEAD_DIM) K or V rows: as stored (KIND 0), or decoded in float32: int8 ``u * scale + zero``
    (KIND 1), fp8 ``x * scale`` (KIND 3)."""
    x = tl.load(x_ptr + rows[:, None] + d[None, :], mask=live[:, None], other=0.0)
    if KIND == 0:
        return x
    scale = tl.load(s_ptr + srows, mask=live, other=0.0).to(tl.float32)
    x = x.to(tl.float32) * scale[:, None]
    if KIND == 1:
        x = x + tl.load(z_ptr + srows, mask=live, other=0.0).to(tl.float32)[:, None]
    return x


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr, tables_ptr, lengths_ptr, acc_ptr, ml_ptr,
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_kt,
    stride_sb, stride_sh,
    stride_tb,
    stride_ab, stride_ah, stride_as,
    stride_mb, stride_mh, stride_ms,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK: tl.constexpr, NUM_SPLITS: tl.constexpr, IEEE: tl.constexpr, KIND: tl.constexpr,
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
        srows = page.to(tl.int64) * stride_sb + kvh * stride_sh + (t % PAGE)
        k = _load_rows(k_ptr, ks_ptr, kz_ptr, rows, srows, d, live, KIND)
        if KIND != 0:  # rounded once to the query's dtype (fp32 models multiply in fp32)
            k = k.to(q.dtype)
        if IEEE:
            s = tl.dot(q.to(k.dtype), tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q.to(k.dtype), tl.trans(k))
        s = tl.where(live[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        den = den * alpha + tl.sum(p, 1)
        v = _load_rows(v_ptr, vs_ptr, vz_ptr, rows, srows, d, live, KIND)
        if KIND != 0:
            v = v.to(q.dtype)
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
    return paged_decode_attention_quantized(q, 0, [k_cache], [v_cache], tables, lengths, splits)


# the KV codecs' planes the kernel decodes: kind -> (data dtype, planes after the data); kind 0: float blocks
QUANTIZED_KINDS = {1: (torch.uint8, ("scale", "zero")), 3: (torch.float8_e4m3fn, ("scale",))}


def paged_decode_attention_quantized(
    q: torch.Tensor,
    kind: int,
    k_planes: list[torch.Tensor],
    v_planes: list[torch.Tensor],
    tables: torch.Tensor,
    lengths: torch.Tensor,
    splits: int | None = None,
) -> torch.Tensor:
    """``paged_decode_attention`` over int8 (``kind`` 1: planes data uint8, scale and zero fp16) or fp8 (3: data
    float8 e4m3, scale fp16) blocks: data (num_blocks, nkv, bs, hd), scales (num_blocks, nkv, bs). Kind 0 (the
    float blocks of ``paged_decode_attention``) takes the data plane alone."""
    if kind != 0 and kind not in QUANTIZED_KINDS:
        raise ValueError(f"the GPU decode kernel reads int8 (1) and fp8 (3) KV blocks, not kind {kind}")
    if kind:
        data_dtype, params = QUANTIZED_KINDS[kind]
        for planes in (k_planes, v_planes):
            if len(planes) != 1 + len(params) or planes[0].dtype != data_dtype:
                raise ValueError(f"kind {kind} needs planes (data {data_dtype}, {', '.join(params)})")
            if any(p.dtype != torch.float16 or p.shape != planes[0].shape[:-1] for p in planes[1:]):
                raise ValueError("the KV scales and zero points must be fp16 (num_blocks, nkv, bs)")
            if any(p.stride(-1) != 1 or p.stride()[:2] != planes[1].stride()[:2] for p in planes[2:]):
                raise ValueError("a KV scale and its zero point must be laid out alike")
    k_cache, v_cache = k_planes[0], v_planes[0]
    batch, num_heads, head_dim = q.shape
    _, num_kv_heads, page, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim or head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"head_dim {head_dim} unsupported by the GPU decode kernel (a power of two >= 16)")
    if k_cache.stride(-1) != 1 or q.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("the GPU decode kernel needs the last dimension contiguous, K and V laid out alike")
    # scale and zero planes (the data's own tensor where there are none: never read)
    ks, kz = (k_planes[1:] + [k_cache] * 2)[:2]
    vs, vz = (v_planes[1:] + [v_cache] * 2)[:2]
    if kind and (ks.stride() != vs.stride() or ks.stride(-1) != 1):
        raise ValueError("the GPU decode kernel needs K's and V's scales laid out alike, tokens contiguous")
    s_strides = (ks.stride(0), ks.stride(1)) if kind else (0, 0)
    group = num_heads // num_kv_heads
    splits = splits or num_splits(batch, num_kv_heads, _multiprocessors(q.device))
    acc = torch.empty(batch, num_heads, splits, head_dim, device=q.device, dtype=torch.float32)
    ml = torch.empty(batch, num_heads, splits, 2, device=q.device, dtype=torch.float32)
    ieee = (k_cache.dtype if kind == 0 else q.dtype) == torch.float32
    _decode_split_kernel[(batch, num_kv_heads, splits)](
        q, k_cache, v_cache, ks, kz, vs, vz, tables, lengths, acc, ml,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        s_strides[0], s_strides[1],
        tables.stride(0),
        acc.stride(0), acc.stride(1), acc.stride(2),
        ml.stride(0), ml.stride(1), ml.stride(2),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, PAGE=page,
        BLOCK=BLOCK_N, NUM_SPLITS=splits, IEEE=ieee, KIND=kind,
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
