"""The fused CPU kernels against their plain torch definitions, and the model with and without them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mcp2026 import hardware
from mcp2026.kernels import cpu, ops


def _tol(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 2e-2


@pytest.fixture
def no_vnni_gemm(monkeypatch):
    """As on a CPU without AVX-512 VNNI: int4 and int8 layers route by row count (GEMV, dequantize + GEMM,
    torch)."""
    monkeypatch.setattr(ops, "vnni_gemm_kernels", lambda x: None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_x", [True, False])
def test_add_rms_norm_matches_torch(kernels, dtype, with_x):
    torch.manual_seed(0)
    residual = torch.randn(5, 96, dtype=dtype)
    x = torch.randn(5, 96, dtype=dtype) if with_x else None
    weight = torch.rand(96, dtype=dtype) + 0.5
    expected_res = residual + x if with_x else residual.clone()
    expected = F.rms_norm(expected_res.float(), (96,), weight.float(), 1e-5)
    out = kernels.add_rms_norm(residual, x, weight, 1e-5, dtype)
    assert out.dtype == dtype
    torch.testing.assert_close(residual, expected_res)  # updated in place
    torch.testing.assert_close(out.float(), expected, atol=_tol(dtype), rtol=_tol(dtype))


def test_add_rms_norm_adds_a_bf16_branch_to_an_fp32_stream(kernels):
    residual, x, weight = torch.randn(2, 64), torch.randn(2, 64).bfloat16(), torch.rand(64) + 0.5
    expected = F.rms_norm(residual + x.float(), (64,), weight, 1e-6)
    torch.testing.assert_close(kernels.add_rms_norm(residual, x, weight, 1e-6, torch.float32), expected)


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float16])
def test_add_rms_norm_reads_a_narrow_weight_as_its_fp32_widening(kernels, weight_dtype):
    torch.manual_seed(1)
    residual, weight = torch.randn(3, 64, dtype=torch.bfloat16), (torch.rand(64) + 0.5).to(weight_dtype)
    out = kernels.add_rms_norm(residual.clone(), None, weight, 1e-6, torch.bfloat16)
    assert torch.equal(
        out, kernels.add_rms_norm(residual.clone(), None, weight.float(), 1e-6, torch.bfloat16)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_torch(kernels, dtype):
    gate_up = torch.randn(3, 2 * 80, dtype=dtype)
    expected = F.silu(gate_up[:, :80].float()) * gate_up[:, 80:].float()
    torch.testing.assert_close(
        kernels.silu_mul(gate_up, dtype).float(), expected, atol=_tol(dtype), rtol=_tol(dtype)
    )


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_of_bf16_is_its_fp32_arithmetic(kernels, out_dtype):
    """bf16 rows run the fp32 rows' vector arithmetic (8 lanes, then a scalar tail: 83 = 10 x 8 + 3) on the
    widened values, and a bf16 output is that result rounded: the same bits as converting around the fp32 call."""
    gate_up = (torch.randn(2, 2 * 83) * 4).bfloat16()
    got = kernels.silu_mul(gate_up, out_dtype)
    expected = kernels.silu_mul(gate_up.float(), torch.float32).to(out_dtype)
    assert got.dtype == out_dtype and torch.equal(got, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_in_place_on_a_strided_view_matches_rotate_half(kernels, dtype):
    from mcp2026.models.rotary import RotaryEmbedding

    rope = RotaryEmbedding(32, 64, 10000.0, None)
    positions = torch.tensor([0, 5, 17])
    cos, sin = rope.table(positions, dtype)
    qkv = torch.randn(3, 7 * 32, dtype=dtype)  # q+k heads (6) and one v head, like the attention's qkv
    qk = qkv[:, : 6 * 32].view(3, 6, 32)
    expected = rope.apply(qk.float(), cos.float(), sin.float())
    v_before = qkv[:, 6 * 32 :].clone()
    assert ops.rope_(qk, cos, sin) is qk
    torch.testing.assert_close(qk.float(), expected, atol=_tol(dtype), rtol=_tol(dtype))
    assert torch.equal(qkv[:, 6 * 32 :], v_before)  # v untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partial_rope_rotates_the_leading_dims_and_passes_the_rest(kernels, dtype):
    from mcp2026.models.rotary import RotaryEmbedding

    rope = RotaryEmbedding(32, 64, 10000.0, None, rotary_dim=24)  # Phi-4-mini's 3/4: pairs (i, i + 12)
    cos, sin = rope.table(torch.tensor([0, 5, 17]), dtype)
    qk = torch.randn(3, 6, 32, dtype=dtype)
    expected = rope.apply(qk.float(), cos.float(), sin.float())
    before = qk.clone()
    assert ops.rope_(qk, cos, sin) is qk
    torch.testing.assert_close(qk.float(), expected, atol=_tol(dtype), rtol=_tol(dtype))
    assert torch.equal(qk[..., 24:], before[..., 24:])  # the pass-through dims, bit for bit
    assert not torch.allclose(qk[1:, :, :24], before[1:, :, :24])  # positions 5 and 17 did rotate


def _reference_attention(q, k_cache, v_cache, tables, lengths, starts=None):
    out = []
    bs = k_cache.shape[2]
    for b in range(q.shape[0]):
        n = int(lengths[b])
        first = 0 if starts is None else int(starts[b])
        blocks = tables[b, : -(-n // bs)]
        k = k_cache[blocks].transpose(0, 1).flatten(1, 2)[:, first:n].float()  # (nkv, n - first, hd)
        v = v_cache[blocks].transpose(0, 1).flatten(1, 2)[:, first:n].float()
        qb = q[b].float()[None, :, None]  # (1, nh, 1, hd)
        o = F.scaled_dot_product_attention(qb, k[None], v[None], scale=1.0, enable_gqa=True)
        out.append(o[0, :, 0])
    return torch.stack(out)


@pytest.mark.parametrize(
    ("dtype", "kv_dtype", "hd", "sharpness"),
    [
        (torch.float32, torch.float32, 32, 1.0),
        (torch.bfloat16, torch.bfloat16, 32, 1.0),
        (torch.float32, torch.bfloat16, 64, 1.0),  # 16-bit cache under fp32 activations, widened on load
        (torch.float32, torch.float16, 24, 1.0),  # hd not a multiple of 16: the 8-wide tails
        (torch.float32, torch.float32, 12, 1.0),  # hd not a multiple of 8: the portable loop
        (torch.float32, torch.float32, 64, 30.0),  # peaked softmax: exp of large negative scores
    ],
)
def test_paged_decode_attention_matches_a_gather_and_softmax(kernels, dtype, kv_dtype, hd, sharpness):
    torch.manual_seed(1)
    num_blocks, nkv, bs, nh = 40, 2, 16, 6
    k_cache = torch.randn(num_blocks, nkv, bs, hd).to(kv_dtype)
    v_cache = torch.randn(num_blocks, nkv, bs, hd).to(kv_dtype)
    q = (torch.randn(4, nh, hd) * sharpness / hd**0.5).to(dtype)
    tables = torch.randperm(num_blocks)[:20].view(4, 5)  # scattered blocks, in position order per row
    tables[0, 1:] = -1  # a short sequence: padding past its blocks is never read
    lengths = torch.tensor([1, 16, 17, 77])
    out = kernels.paged_decode_attention(q, k_cache, v_cache, tables, lengths)
    assert out.dtype == dtype
    expected = _reference_attention(q, k_cache, v_cache, tables, lengths)
    tol = _tol(dtype) * sharpness  # scores 30x larger: their fp32 rounding moves the softmax 30x more
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize(
    ("hd", "group", "bs"), [(32, 1, 16), (64, 3, 16), (96, 4, 16), (128, 7, 32), (256, 8, 16), (256, 4, 8)]
)
def test_bf16_decode_attention_over_head_sizes_and_groups(kernels, hd, group, bs):
    """bf16 queries over bf16 blocks (where the CPU has AVX-512 BF16: its dot-product path, 16 key rows a pass,
    value accumulators held per group): every head size and group it takes, partial blocks and passes, and the
    per-block attention mass, against a float32 reference."""
    torch.manual_seed(5)
    num_blocks, nkv = 80, 2
    nh = nkv * group
    k_cache = torch.randn(num_blocks, nkv, bs, hd).bfloat16()
    v_cache = torch.randn(num_blocks, nkv, bs, hd).bfloat16()
    q = (torch.randn(4, nh, hd) / hd**0.5).bfloat16()
    lengths = torch.tensor([1, 9, bs + 3, 150])
    nb = -(-150 // bs)
    tables = torch.randperm(num_blocks)[: 4 * nb].view(4, nb)
    out = kernels.paged_decode_attention(q, k_cache, v_cache, tables, lengths)
    expected = _reference_attention(q, k_cache, v_cache, tables, lengths)
    torch.testing.assert_close(out.float(), expected, atol=_tol(torch.bfloat16), rtol=_tol(torch.bfloat16))
    mass = torch.zeros(4, nkv, nb)
    assert torch.equal(kernels.paged_decode_attention(q, k_cache, v_cache, tables, lengths, mass), out)
    # each query head's probabilities sum to 1 over the blocks: a KV head's row holds its group's total
    used = torch.arange(nb)[None, :] < (-(-lengths // bs))[:, None]
    torch.testing.assert_close(mass.sum(-1), torch.full((4, nkv), float(group)), atol=1e-4, rtol=1e-4)
    assert (mass[~used[:, None, :].expand(-1, nkv, -1)] == 0).all()


@pytest.mark.parametrize(("dtype", "hd"), [(torch.float32, 32), (torch.bfloat16, 64), (torch.float32, 12)])
def test_paged_decode_attention_from_a_window_start(kernels, dtype, hd):
    """A sliding window's first position per sequence: on a block boundary, inside a block (the block's
    positions before it masked), in the last block, and 0 (the whole context)."""
    torch.manual_seed(3)
    num_blocks, nkv, bs, nh = 40, 2, 16, 4
    k_cache = torch.randn(num_blocks, nkv, bs, hd).to(dtype)
    v_cache = torch.randn(num_blocks, nkv, bs, hd).to(dtype)
    q = (torch.randn(5, nh, hd) / hd**0.5).to(dtype)
    tables = torch.randperm(num_blocks)[:25].view(5, 5)
    lengths = torch.tensor([77, 77, 77, 40, 33])
    starts = torch.tensor([32, 37, 76, 0, 20])
    out = kernels.paged_decode_attention(q, k_cache, v_cache, tables, lengths, None, starts)
    expected = _reference_attention(q, k_cache, v_cache, tables, lengths, starts)
    torch.testing.assert_close(out.float(), expected, atol=_tol(dtype), rtol=_tol(dtype))
    whole = kernels.paged_decode_attention(q, k_cache, v_cache, tables, lengths)
    assert torch.equal(out[3], whole[3]) and not torch.allclose(out[1].float(), whole[1].float())
    with pytest.raises(RuntimeError, match="window start must lie before its length"):
        kernels.paged_decode_attention(q, k_cache, v_cache, tables, lengths, None, lengths)
    with pytest.raises(RuntimeError, match="do not combine"):
        mass = torch.zeros(5, nkv, 5)
        kernels.paged_decode_attention(q, k_cache, v_cache, tables, lengths, mass, starts)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("length", [5, 100, 700])
def test_decode_attention_split_by_query_head_gives_the_kv_head_split_bits(kernels, batch, length):
    """A batch-1 step has fewer (sequence, KV head) pairs than threads want (3 KV heads on 2 threads): the
    kernel then splits by query head. Recording attention mass keeps the split by KV head; both give the
    same bits, and the reference's values."""
    torch.manual_seed(2)
    num_blocks, nkv, bs, nh, hd = 128, 3, 16, 9, 64
    k_cache = torch.randn(num_blocks, nkv, bs, hd).bfloat16()
    v_cache = torch.randn(num_blocks, nkv, bs, hd).bfloat16()
    q = (torch.randn(batch, nh, hd) / hd**0.5).bfloat16()
    nb = -(-length // bs)
    tables = torch.randperm(num_blocks)[: batch * nb].view(batch, nb)
    lengths = torch.full((batch,), length)
    out = kernels.paged_decode_attention(q, k_cache, v_cache, tables, lengths)
    mass = torch.zeros(batch, nkv, nb)
    by_kv_head = kernels.paged_decode_attention(q, k_cache, v_cache, tables, lengths, mass)
    assert torch.equal(out, by_kv_head)
    expected = _reference_attention(q, k_cache, v_cache, tables, lengths)
    torch.testing.assert_close(out.float(), expected, atol=_tol(torch.bfloat16), rtol=_tol(torch.bfloat16))


@pytest.mark.parametrize(
    ("dtype", "kv", "hd"),
    [
        (torch.bfloat16, torch.bfloat16, 64),  # the AVX-512 BF16 path where the CPU has it
        (torch.float32, torch.bfloat16, 64),
        (torch.float32, torch.float32, 12),  # the portable loops
        (torch.float32, "int8", 64),
        (torch.float32, "int4", 64),
        (torch.bfloat16, "fp8", 64),
    ],
)
def test_long_contexts_are_cut_by_position_and_keep_their_bits_in_any_batch(kernels, dtype, kv, hd):
    """Contexts longer than one range are computed range by range (cut at fixed positions) and merged: against
    the reference across one, two and several ranges and partial blocks; each sequence alone gives the bits it
    gets in the batch (batch 1 splits work differently from a batch); recording the attention mass changes no
    bit, and the mass of each KV head sums to its query heads over the blocks."""
    torch.manual_seed(7)
    num_blocks, nkv, bs, nh = 400, 2, 16, 6
    if isinstance(kv, str):
        kind = {"int8": 1, "int4": 2, "fp8": 3}[kv]
        kp, vp, k_cache, v_cache = _quantized_pool(kv, num_blocks, nkv, bs, hd)
        empty = torch.empty(0)

        def attend(q, tables, lengths, mass=None):
            return ops.paged_decode_attention_quantized(q, kind, kp, vp, empty, empty, tables, lengths, mass)

        tol = _int_dot_tol(dtype) if kind in (1, 2) else _tol(dtype)
    else:
        k_cache = torch.randn(num_blocks, nkv, bs, hd).to(kv)
        v_cache = torch.randn(num_blocks, nkv, bs, hd).to(kv)

        def attend(q, tables, lengths, mass=None):
            return kernels.paged_decode_attention(q, k_cache, v_cache, tables, lengths, mass)

        tol = _tol(dtype)
    lengths = torch.tensor([1, 700, 1024, 1025, 2049, 3100])
    nb = -(-3100 // bs)
    tables = torch.randint(0, num_blocks, (len(lengths), nb))  # blocks may repeat: reads only
    q = (torch.randn(len(lengths), nh, hd) / hd**0.5).to(dtype)
    out = attend(q, tables, lengths)
    expected = _reference_attention(q, k_cache, v_cache, tables, lengths)
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)
    for b in range(len(lengths)):
        alone = attend(q[b : b + 1], tables[b : b + 1], lengths[b : b + 1])
        assert torch.equal(alone[0], out[b]), f"sequence {b} ({int(lengths[b])} tokens) alone"
    mass = torch.zeros(len(lengths), nkv, nb)
    assert torch.equal(attend(q, tables, lengths, mass), out)
    used = torch.arange(nb)[None, :] < (-(-lengths // bs))[:, None]
    torch.testing.assert_close(mass.sum(-1), torch.full((len(lengths), nkv), nh / nkv), atol=1e-4, rtol=1e-4)
    assert (mass[~used[:, None, :].expand(-1, nkv, -1)] == 0).all()
    b, n = 4, int(lengths[4])  # one cut sequence's mass per block against the reference probabilities
    k = k_cache[tables[b, : -(-n // bs)]].transpose(0, 1).flatten(1, 2)[:, :n].float()
    scores = torch.einsum("kgd,ktd->kgt", q[b].float().view(nkv, nh // nkv, hd), k)
    per_token = torch.softmax(scores, -1).sum(1)
    reference = torch.zeros(nkv, nb).index_add_(1, torch.arange(n) // bs, per_token)
    torch.testing.assert_close(mass[b], reference, atol=1e-3, rtol=1e-3)


def test_window_starts_in_a_later_range(kernels):
    """A sliding window whose first position lies past the first range (the ranges before it not read) or
    inside a range's first block."""
    torch.manual_seed(8)
    num_blocks, nkv, bs, nh, hd = 200, 3, 16, 9, 64
    k_cache = torch.randn(num_blocks, nkv, bs, hd).bfloat16()
    v_cache = torch.randn(num_blocks, nkv, bs, hd).bfloat16()
    lengths = torch.tensor([2100, 2100, 1500, 600])
    starts = torch.tensor([1100, 1024, 1499, 0])
    tables = torch.randint(0, num_blocks, (4, -(-2100 // bs)))
    q = (torch.randn(4, nh, hd) / hd**0.5).bfloat16()
    out = kernels.paged_decode_attention(q, k_cache, v_cache, tables, lengths, None, starts)
    expected = _reference_attention(q, k_cache, v_cache, tables, lengths, starts)
    torch.testing.assert_close(out.float(), expected, atol=_tol(torch.bfloat16), rtol=_tol(torch.bfloat16))
    for b in range(4):
        alone = kernels.paged_decode_attention(
            q[b : b + 1], k_cache, v_cache, tables[b : b + 1], lengths[b : b + 1], None, starts[b : b + 1]
        )
        assert torch.equal(alone[0], out[b])


def _quantized_pool(codec_name: str, num_blocks: int, nkv: int, bs: int, hd: int):
    """A pool of random blocks through a KV codec: (K planes, V planes, decoded K, decoded V) in the
    (num_blocks, nkv, ...) layout of kv.paged_cache."""
    from mcp2026.kv.codecs import make_codec

    codec = make_codec(codec_name)
    out = []
    for tc, spread in ((codec.key, 4.0), (codec.value, 1.0)):
        x = torch.randn(num_blocks * nkv, bs, hd) * spread
        x[:, :, 1] += 6.0  # an offset channel, as keys have
        planes = tc.encode(x)
        shaped = [p.reshape(num_blocks, nkv, *p.shape[1:]).contiguous() for p in planes.values()]
        out.append((shaped, tc.decode(planes, torch.float32).view(num_blocks, nkv, bs, hd)))
    (kp, k), (vp, v) = out
    return kp, vp, k, v


@pytest.mark.parametrize(
    ("codec", "kind", "hd", "dtype"),
    [
        ("int8", 1, 64, torch.float32),
        ("int8", 1, 12, torch.float32),  # hd not a multiple of 8: the portable loops
        ("int4", 2, 64, torch.float32),
        ("int4", 2, 64, torch.bfloat16),
        ("int4-g64", 2, 64, torch.float32),
        ("int4", 2, 96, torch.float32),  # 96 channels: one 32-wide AVX2 step short of a 64-multiple
        ("fp8", 3, 64, torch.float32),
        ("fp8", 3, 20, torch.bfloat16),  # the 8-wide gather and a scalar tail
    ],
)
def test_quantized_decode_attention_matches_the_decoded_pool(kernels, codec, kind, hd, dtype):
    """The kernel decodes blocks as it reads them: same result as attention over the codec's own decode,
    staged (bf16) tails read from staging, block mass as the plain kernel's."""
    torch.manual_seed(3)
    num_blocks, nkv, bs, nh = 24, 2, 16, 6
    kp, vp, k, v = _quantized_pool(codec, num_blocks, nkv, bs, hd)
    stage_k = torch.randn(3, nkv, bs, hd).bfloat16()  # staging entries 0..2 = ids num_blocks + i
    stage_v = torch.randn(3, nkv, bs, hd).bfloat16()
    k_all = torch.cat([k, stage_k.float()]) if kind == 2 else k
    v_all = torch.cat([v, stage_v.float()]) if kind == 2 else v
    q = (torch.randn(3, nh, hd) / hd**0.5).to(dtype)
    tables = torch.randperm(num_blocks)[:12].view(3, 4)
    lengths = torch.tensor([5, 40, 64])
    if kind == 2:
        tables[1, 2] = num_blocks + 2  # the staged tail of a 40-token sequence
        tables[0, 0] = num_blocks  # a sequence still in its first block
    args = (stage_k, stage_v) if kind == 2 else (torch.empty(0), torch.empty(0))
    mass = torch.zeros(3, nkv, 4)
    out = ops.paged_decode_attention_quantized(q, kind, kp, vp, *args, tables, lengths, mass)
    assert out.dtype == dtype
    expected = _reference_attention(q, k_all, v_all, tables, lengths)
    tol = _int_dot_tol(dtype) if kind in (1, 2) and hd % 64 == 0 else _tol(dtype)
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)
    plain_mass = torch.zeros(3, nkv, 4)
    ops.paged_decode_attention(q.float(), k_all, v_all, tables, lengths, plain_mass)
    torch.testing.assert_close(mass, plain_mass, atol=tol, rtol=tol)


def _int_dot_tol(dtype: torch.dtype) -> float:
    # int8 and int4 keys (64 or 128 channels) are scored with integer dot products against the query rounded to
    # int16 (per head; for int4 folded with each block's channel scales), relative error <= 2^-16 of its largest
    # entry: outputs move by up to ~2e-4 here, far below the codes' own error
    return 1e-3 if dtype == torch.float32 else _tol(dtype)


@pytest.mark.parametrize("codec", ["int8", "int4"])
@pytest.mark.parametrize(
    ("nh", "nkv", "bs", "hd"),
    [(4, 4, 8, 64), (4, 2, 16, 64), (8, 2, 32, 64), (10, 2, 16, 128), (8, 1, 16, 64)],
)
def test_integer_key_paths_over_head_groups_and_block_sizes(kernels, codec, nh, nkv, bs, hd):
    """The int8 and int4 kernels' integer key scoring (and int4's register-blocked values) for 1, 2, 4, 5 and 8
    query heads per KV head, 8- and 32-token blocks (rows in groups of 8, a partial last block) and two
    64-channel chunks, against attention over the codec's own decode; for int4 a staged block among coded ones."""
    torch.manual_seed(5)
    num_blocks = 12
    kp, vp, k, v = _quantized_pool(codec, num_blocks, nkv, bs, hd)
    q = torch.randn(2, nh, hd) / hd**0.5
    tables = torch.randperm(num_blocks)[:8].view(2, 4)
    lengths = torch.tensor([3 * bs + 5, 4 * bs - 3])
    kind, stage_k, stage_v = 1, torch.empty(0), torch.empty(0)
    if codec == "int4":
        kind = 2
        stage_k = torch.randn(2, nkv, bs, hd).bfloat16()
        stage_v = torch.randn(2, nkv, bs, hd).bfloat16()
        k, v = torch.cat([k, stage_k.float()]), torch.cat([v, stage_v.float()])
        tables[1, 3] = num_blocks + 1
    out = ops.paged_decode_attention_quantized(q, kind, kp, vp, stage_k, stage_v, tables, lengths, None)
    expected = _reference_attention(q, k, v, tables, lengths)
    tol = _int_dot_tol(torch.float32)
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)


def test_quantized_decode_attention_rejects_bad_input(kernels):
    kp, vp, _, _ = _quantized_pool("int4", 4, 1, 16, 32)
    q = torch.zeros(1, 1, 32)
    empty = torch.empty(0)
    with pytest.raises(RuntimeError, match="block id out of range"):  # a staged id with no staging
        ops.paged_decode_attention_quantized(
            q, 2, kp, vp, empty, empty, torch.tensor([[4]]), torch.tensor([3])
        )
    with pytest.raises(RuntimeError, match="takes 4 planes"):
        ops.paged_decode_attention_quantized(
            q, 2, kp[:3], vp, empty, empty, torch.tensor([[0]]), torch.tensor([3])
        )
    with pytest.raises(RuntimeError, match="kind must be"):
        ops.paged_decode_attention_quantized(
            q, 4, kp, vp, empty, empty, torch.tensor([[0]]), torch.tensor([3])
        )


def test_fp8_table_decodes_every_code_as_torch(kernels):
    """All finite e4m3 codes through the kernel's table: one token of one head, so the output is that token's
    decoded values, compared exactly with torch's conversion."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    values = codes[torch.isfinite(codes.float())]  # 254 finite codes as the channels of one row
    hd = values.numel()
    k = torch.zeros(1, 1, 1, hd, dtype=torch.float8_e4m3fn)
    v = values.reshape(1, 1, 1, hd).contiguous()
    scale = torch.ones(1, 1, 1, dtype=torch.float16)
    q = torch.zeros(1, 1, hd)
    empty = torch.empty(0)
    tables, lengths = torch.tensor([[0]]), torch.tensor([1])
    out = ops.paged_decode_attention_quantized(q, 3, [k, scale], [v, scale], empty, empty, tables, lengths)
    torch.testing.assert_close(out.view(-1), values.float(), atol=0, rtol=0)


def test_paged_decode_attention_rejects_bad_tables(kernels):
    k_cache = torch.zeros(4, 1, 16, 8)
    q = torch.zeros(1, 1, 8)
    with pytest.raises(RuntimeError, match="block id out of range"):
        kernels.paged_decode_attention(q, k_cache, k_cache, torch.tensor([[7]]), torch.tensor([3]))
    with pytest.raises(RuntimeError, match="length out of range"):
        kernels.paged_decode_attention(q, k_cache, k_cache, torch.tensor([[0]]), torch.tensor([17]))


@pytest.mark.parametrize(("group_size", "k"), [(32, 192), (64, 192), (32, 800)])  # 800: 25 blocks, one odd
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 20, 64])  # one row, a partial tile, full 8-row tiles + rests
def test_int4_gemv_is_exact_integer_math_and_close_to_the_weights(kernels, group_size, k, rows):
    from mcp2026.quant.int4_linear import Int4Linear
    from mcp2026.quant.int4_packing import gemv_layout, unpack_int4
    from mcp2026.quant.plan import LayerQuantSpec

    torch.manual_seed(2)
    linear = torch.nn.Linear(k, 96, bias=False)
    q = Int4Linear.from_linear(linear, LayerQuantSpec("int4", group_size=group_size), torch.bfloat16)
    packed, sz = gemv_layout(unpack_int4(q.weight, 96, k), q.scales_and_zeros, group_size)
    x = torch.randn(rows, k)
    y = kernels.int4_gemv(x, packed, sz)
    # the kernel's definition: per 32-block int8 activations (absmax / 127), w = (q - 8) * scale + zero
    xb = x.view(rows, k // 32, 32)
    dx = xb.abs().amax(-1, keepdim=True) / 127
    xq = torch.round(xb / dx) * dx
    scale, zero = sz.float().unbind(-1)
    w = (torch.cat([packed & 15, packed >> 4], dim=-1).float() - 8) * scale.unsqueeze(-1) + zero.unsqueeze(-1)
    torch.testing.assert_close(y, xq.view(rows, k) @ w.view(96, k).T, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(w.view(96, k), q.dequantize())
    exact = x @ q.dequantize().T
    assert ((y - exact).norm() / exact.norm()).item() < 0.01  # int8 activations: ~0.5% measured


# 6 blocks (all leftover), 7 and 25 (a last odd block), 18 (2 groups of 8 + 2; VNNI: 16 + a pair), 48
@pytest.mark.parametrize("k", [192, 224, 576, 800, 1536])
def test_int4_gemv_gives_a_row_the_same_bits_in_any_batch(kernels, k):
    # batched == alone for int4 models rests on this: each row's arithmetic must not depend on the others
    torch.manual_seed(3)
    packed = torch.randint(0, 256, (40, k // 32, 16), dtype=torch.uint8)
    sz = (torch.rand(40, k // 32, 2) * 0.02 + 0.001).to(torch.float16)
    x = torch.randn(20, k)
    batched = kernels.int4_gemv(x, packed, sz)
    for i in range(20):
        assert torch.equal(kernels.int4_gemv(x[i : i + 1], packed, sz), batched[i : i + 1])
    assert torch.equal(kernels.int4_gemv(x[3:8], packed, sz), batched[3:8])


@pytest.mark.parametrize("fast_bf16", [True, False])
@pytest.mark.usefixtures("no_vnni_gemm")
def test_int4_linear_takes_the_gemv_for_decode_sized_batches_only(kernels, fast_bf16, monkeypatch):
    from mcp2026.quant import cpu_routing as routing
    from mcp2026.quant import linear as qlinear
    from mcp2026.quant.plan import LayerQuantSpec

    monkeypatch.setattr(routing, "cpu_has_fast_bf16", lambda: fast_bf16)
    calls = []
    monkeypatch.setattr(cpu, "_module", _Spy(kernels, calls))
    q = qlinear.Int4Linear.from_linear(torch.nn.Linear(64, 32), LayerQuantSpec("int4"), torch.bfloat16)
    with torch.inference_mode():
        for rows in (
            2,
            routing.GEMV_MAX_ROWS + 1,
            routing.INT4_GEMV_BATCH_MAX_ROWS,
            routing.INT4_DEQUANT_MIN_ROWS,
        ):
            assert q(torch.randn(rows, 64)).shape == (rows, 32)
    # batched decode and mid-sized steps take the GEMV only where torch's int kernel would compute in slow bf16
    gemv_rows = [2] if fast_bf16 else [2, routing.GEMV_MAX_ROWS + 1, routing.INT4_GEMV_BATCH_MAX_ROWS]
    assert [rows for name, rows in calls if name == "int4_gemv"] == gemv_rows
    # prefill: dequantize + GEMM, fp32 past the GEMV's rows; bf16 past a fused step's rows where bf16 is fast
    assert sum(name == "int4_dequant" for name, _ in calls) == (2 if fast_bf16 else 1)
    assert "_gemv" in q.__dict__
    q.load_state_dict(q.state_dict())
    assert "_gemv" not in q.__dict__  # new weights: the layout is rebuilt on next use


class _Spy:
    """The kernel module, recording (kernel name, rows of its first argument) per GEMV / dequant call."""

    def __init__(self, module, calls):
        self._module, self._calls = module, calls

    def __getattr__(self, name):
        fn = getattr(self._module, name)

        def call(*args, **kwargs):
            self._calls.append((name, args[0].shape[0]))
            return fn(*args, **kwargs)

        return call


def test_no_kernels_while_recording_gradients(kernels):
    x = torch.randn(2, 8, requires_grad=True)
    assert ops.kernels_for(x) is None
    with torch.no_grad():
        assert ops.kernels_for(x) is kernels
    assert ops.kernels_for(torch.randn(2, 8, dtype=torch.float16)) is None


@pytest.mark.usefixtures("one_thread")
def test_model_logits_equal_with_and_without_kernels(kernels, tiny_llama_dir, monkeypatch):
    from mcp2026.loading.loader import load_model

    model = load_model(tiny_llama_dir).model
    ids = torch.tensor([5, 9, 33, 2, 7, 100, 3])
    positions = torch.arange(len(ids))
    with torch.inference_mode():
        fused = model.compute_logits(model(ids, positions))
        monkeypatch.setattr(cpu, "_module", None)  # as if the build had failed
        plain = model.compute_logits(model(ids, positions))
    torch.testing.assert_close(fused, plain, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 5, 19])
def test_int8_gemv_equals_the_dequantized_matmul(kernels, rows):
    from mcp2026.quant.int8_linear import Int8Linear
    from mcp2026.quant.plan import LayerQuantSpec

    torch.manual_seed(3)
    q = Int8Linear.from_linear(torch.nn.Linear(168, 48, bias=True), LayerQuantSpec("int8"), torch.bfloat16)
    x = torch.randn(rows, 168)  # K not a multiple of 16: the tail loop too
    y = kernels.int8_gemv(x, q.weight, q.scales.float())
    torch.testing.assert_close(y, x @ q.dequantize().T, atol=1e-4, rtol=1e-4)  # float activations: exact
    with torch.inference_mode():
        out = q(x)  # the module: GEMV + bias, in x's dtype
    torch.testing.assert_close(out, x @ q.dequantize().T + q.bias.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.usefixtures("no_vnni_gemm")
def test_activation_scaled_int4_layers_take_the_gemv_with_the_scale(kernels):
    from mcp2026.quant.int4_linear import Int4Linear
    from mcp2026.quant.plan import LayerQuantSpec

    torch.manual_seed(4)
    act_scale = torch.rand(64) + 0.5
    spec = LayerQuantSpec("int4", act_scale="awq")
    q = Int4Linear.from_linear(torch.nn.Linear(64, 32, bias=False), spec, torch.bfloat16, act_scale=act_scale)
    x = torch.randn(1, 64)
    with torch.inference_mode():
        y = q(x)
    assert "_gemv" in q.__dict__
    exact = x @ q.dequantize().T
    assert ((y - exact).norm() / exact.norm()).item() < 0.02


@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.usefixtures("no_vnni_gemm")
def test_prefill_sized_batches_dequantize_to_fp32_where_bf16_is_slow(kernels, fmt, monkeypatch):
    from mcp2026.quant import cpu_routing as routing
    from mcp2026.quant import linear as qlinear
    from mcp2026.quant.plan import LayerQuantSpec

    monkeypatch.setattr(routing, "cpu_has_fast_bf16", lambda: False)
    cls = qlinear.Int4Linear if fmt == "int4" else qlinear.Int8Linear
    q = cls.from_linear(torch.nn.Linear(128, 64, bias=True), LayerQuantSpec(fmt), torch.bfloat16)
    min_rows = routing.INT4_DEQUANT_MIN_ROWS if fmt == "int4" else routing.DEQUANT_MIN_ROWS
    x = torch.randn(min_rows + 3, 128)
    with torch.inference_mode():
        y = q(x)
    expected = x @ q.dequantize().T + q.bias.float()
    torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-4)  # fp32 activations: no bf16 rounding
    monkeypatch.setattr(routing, "cpu_has_fast_bf16", lambda: True)  # the int kernel (bf16) instead
    with torch.inference_mode():
        y_bf16 = q(x)
    assert not torch.allclose(y_bf16, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.usefixtures("no_vnni_gemm")
def test_int4_prefill_where_bf16_is_fast_is_a_bf16_gemm_on_the_dequantized_weights(kernels, monkeypatch):
    from mcp2026.quant import cpu_routing as routing
    from mcp2026.quant import linear as qlinear
    from mcp2026.quant.plan import LayerQuantSpec

    monkeypatch.setattr(routing, "cpu_has_fast_bf16", lambda: True)
    q = qlinear.Int4Linear.from_linear(
        torch.nn.Linear(128, 64, bias=True), LayerQuantSpec("int4"), torch.bfloat16
    )
    qs, sz = q.gemv_weights()
    w = kernels.int4_dequant(qs, sz, out_bf16=True)
    assert w.dtype == torch.bfloat16 and torch.equal(w, kernels.int4_dequant(qs, sz).to(torch.bfloat16))
    buffer = torch.full((64 * 128,), float("nan"), dtype=torch.bfloat16)
    assert torch.equal(kernels.int4_dequant(qs, sz, out_bf16=True, out=buffer), w)
    assert torch.equal(buffer.view(64, 128), w)  # written in place, no copy
    with pytest.raises(RuntimeError, match="out must be"):
        kernels.int4_dequant(qs, sz, out_bf16=True, out=torch.empty(64 * 128))  # fp32 buffer for bf16 output
    x = torch.randn(routing.INT4_BF16_DEQUANT_MIN_ROWS, 128)
    with torch.inference_mode():
        y = q(x)
    expected = (torch.nn.functional.linear(x.bfloat16(), q.dequantize().bfloat16()) + q.bias).float()
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)


def test_paged_decode_attention_adds_each_heads_block_mass(kernels):
    torch.manual_seed(5)
    num_blocks, nkv, bs, hd, nh = 12, 2, 4, 16, 4
    k_cache, v_cache = torch.randn(num_blocks, nkv, bs, hd), torch.randn(num_blocks, nkv, bs, hd)
    q = torch.randn(2, nh, hd) / 4
    tables = torch.tensor([[3, 7, 1], [5, 2, -1]])
    lengths = torch.tensor([10, 6])
    mass = torch.ones(2, nkv, 3)  # per KV head; accumulated, not overwritten
    ops.paged_decode_attention(q, k_cache, v_cache, tables, lengths, mass)
    for b in range(2):
        n = int(lengths[b])
        k = k_cache[tables[b, : -(-n // bs)]].transpose(0, 1).flatten(1, 2)[:, :n]  # (nkv, n, hd)
        scores = torch.einsum("kgd,ktd->kgt", q[b].view(nkv, nh // nkv, hd), k)
        per_token = torch.softmax(scores, -1).sum(1)  # (nkv, n): a KV head's query heads summed
        expected = torch.zeros(nkv, 3).index_add_(1, torch.arange(n) // bs, per_token) + 1
        torch.testing.assert_close(mass[b], expected)


def test_build_key_follows_instruction_sets_only(monkeypatch):
    from mcp2026 import hardware

    base = frozenset({"avx2", "fma", "f16c", "sse4_2", "constant_tsc", "hypervisor", "ibpb"})
    monkeypatch.setattr(hardware, "cpu_flags", lambda: base)
    key = cpu.build_key()
    monkeypatch.setattr(hardware, "cpu_flags", lambda: base - {"ibpb", "hypervisor"} | {"ibrs"})
    assert cpu.build_key() == key  # mitigation / hypervisor bits: same binary
    monkeypatch.setattr(hardware, "cpu_flags", lambda: base | {"avx512f"})
    assert cpu.build_key() != key  # a new instruction set: a new build


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
# partial and full 4-row tiles, and past the GEMV's row limit
@pytest.mark.parametrize("rows", [1, 3, 4, 7, 32, 33, 64])
@pytest.mark.parametrize("n", [99, 100, 101])  # weight rows in tiles of 3, with each remainder
def test_dense_linear_matches_f_linear(kernels, wdtype, rows, n):
    torch.manual_seed(rows + n)
    x, w, b = torch.randn(rows, 96), torch.randn(n, 96).to(wdtype), torch.randn(n).to(wdtype)
    got = kernels.dense_linear(x, w, b)
    assert got.dtype == torch.float32
    # fp32 activations compute in fp32 at any row count (bf16 weights widened, x never rounded to bf16)
    torch.testing.assert_close(got, F.linear(x, w.float(), b.float()), rtol=1e-4, atol=1e-3)
    xb = x.to(torch.bfloat16)  # bf16 activations come back in bf16
    yb = kernels.dense_linear(xb, w, b)
    assert yb.dtype == torch.bfloat16
    torch.testing.assert_close(yb.float(), F.linear(xb.float(), w.float(), b.float()), rtol=2e-2, atol=0.1)


def test_dense_linear_takes_at_linear_when_k_is_not_a_multiple_of_8(kernels):
    torch.manual_seed(6)
    x, w = torch.randn(3, 100), torch.randn(20, 100)
    torch.testing.assert_close(kernels.dense_linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_dense_linear_gives_a_row_the_same_bits_in_any_batch(kernels):
    # batched == alone for float models rests on this (inside the GEMV's row limit, on CPUs it compiles for)
    if not {"avx2", "fma"} <= hardware.cpu_flags():
        pytest.skip("the dense GEMV is compiled for AVX2 + FMA only; elsewhere dense_linear is at::linear")
    torch.manual_seed(4)
    w, x = torch.randn(50, 576), torch.randn(kernels.DENSE_GEMV_MAX_ROWS, 576)
    batched = kernels.dense_linear(x, w)
    for i in range(x.shape[0]):
        assert torch.equal(kernels.dense_linear(x[i : i + 1], w), batched[i : i + 1])
    assert torch.equal(kernels.dense_linear(x[5:11], w), batched[5:11])


def test_model_linears_and_bf16_dense_layers_take_dense_linear(kernels, monkeypatch):
    from mcp2026.models.layers import Linear
    from mcp2026.quant import linear as qlinear
    from mcp2026.quant.plan import LayerQuantSpec

    calls = []
    monkeypatch.setattr(cpu, "_module", _Spy(kernels, calls))
    lin = Linear(64, 32)
    bf16 = qlinear.DenseLinear.from_linear(torch.nn.Linear(64, 32), LayerQuantSpec("bf16"), torch.bfloat16)
    with torch.inference_mode():
        lin(torch.randn(2, 64))
        bf16(torch.randn(2, 64))
    assert calls == [("dense_linear", 2), ("dense_linear", 2)]


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_prefill_linear_matches_f_linear_and_steps_aside_for_autograd(wdtype, monkeypatch):
    torch.manual_seed(5)
    x, w, b = torch.randn(ops.FUSED_MAX_ROWS + 40, 96), torch.randn(50, 96).to(wdtype), torch.randn(50)
    expected = F.linear(x, w.float(), b)
    torch.testing.assert_close(ops.prefill_linear(x, w, b), expected, rtol=1e-4, atol=1e-4)
    calls = []
    real = ops._onednn_linear()
    if real is not None:  # prefill-sized CPU inputs take oneDNN; gradients, small inputs and A/B off do not
        monkeypatch.setattr(ops, "_onednn_linear", lambda: lambda *a: calls.append(a[0].shape[0]) or real(*a))
        ops.prefill_linear(x, w, b)
        ops.prefill_linear(x[: ops.FUSED_MAX_ROWS], w, b)
        monkeypatch.setattr(ops, "ONEDNN_PREFILL", False)
        ops.prefill_linear(x, w, b)
        assert calls == [x.shape[0]]
    wg = torch.nn.Parameter(torch.randn(50, 96))
    y = ops.prefill_linear(x, wg, None)
    y.sum().backward()  # F.linear under autograd: gradients flow
    torch.testing.assert_close(wg.grad, x.sum(0).expand(50, -1))


@pytest.mark.parametrize("rows", [2, ops.FUSED_MAX_ROWS + 8])  # our GEMV, then oneDNN
def test_a_trainable_bias_alone_still_gets_its_gradient(rows):
    # calibration-style: frozen weight, trainable bias; no kernel may drop the bias's gradient
    from mcp2026.models.layers import Linear

    lin = Linear(96, 50)
    lin.weight.requires_grad_(False)
    lin(torch.randn(rows, 96)).sum().backward()
    torch.testing.assert_close(lin.bias.grad, torch.full((50,), float(rows)))


def test_scratch_buffers_are_reused_within_a_thread_and_private_to_it():
    import threading

    from mcp2026.kernels import ops

    a = ops.scratch((4, 8), torch.bfloat16)
    b = ops.scratch((2, 8), torch.bfloat16)
    assert a.shape == (4, 8) and b.shape == (2, 8) and a.data_ptr() == b.data_ptr()  # one buffer, reused
    assert ops.scratch((4, 8), torch.float32).data_ptr() != a.data_ptr()  # one per dtype
    assert ops.scratch((64, 8), torch.bfloat16).numel() == 512  # grows when asked for more
    other = []
    thread = threading.Thread(target=lambda: other.append(ops.scratch((64, 8), torch.bfloat16).data_ptr()))
    thread.start()
    thread.join()
    assert other[0] != ops.scratch((64, 8), torch.bfloat16).data_ptr()  # engines on two threads never share


def _sdpa_at_offset(q, k, v, offset):
    t, s = q.shape[0], k.shape[1]
    mask = torch.arange(s)[None, :] <= (offset + torch.arange(t))[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k[None].float(), v[None].float(), attn_mask=mask, scale=1.0, enable_gqa=True
    )
    return out[0].transpose(0, 1)


@pytest.mark.parametrize(
    ("t", "s", "offset", "nh", "nkv", "hd", "kv_dtype"),
    [
        (200, 200, 0, 9, 3, 64, torch.float32),  # a first chunk: causal (SmolLM2's heads)
        (97, 300, 150, 9, 3, 64, torch.bfloat16),  # a later chunk over cached bf16 K/V, padding slots past it
        (70, 70, 0, 8, 2, 128, torch.float32),  # tails of every tile: 70 positions, 4 per tile
        (65, 130, 65, 4, 4, 32, torch.float32),  # no grouping
        (3, 40, 37, 12, 1, 64, torch.float32),  # 12 heads on one KV head: one position per tile
    ],
)
def test_prefill_attention_matches_sdpa(kernels, t, s, offset, nh, nkv, hd, kv_dtype):
    if not kernels.prefill_attention_available():
        pytest.skip("this CPU build has no AVX-512 prefill attention")
    torch.manual_seed(0)
    q = torch.randn(t, nh, hd) * 0.4
    k, v = torch.randn(nkv, s, hd).to(kv_dtype), torch.randn(nkv, s, hd).to(kv_dtype)
    out = kernels.prefill_attention(q, k, v, offset)
    torch.testing.assert_close(out, _sdpa_at_offset(q, k, v, offset), atol=2e-5, rtol=1e-4)
    with pytest.raises(RuntimeError, match="offset"):
        kernels.prefill_attention(q, k, v, s - t + 1)  # the chunk's own keys must be in k


def test_prefill_attention_of_bf16_queries_is_the_fp32_result_rounded_once(kernels):
    if not kernels.prefill_attention_available():
        pytest.skip("this CPU build has no AVX-512 prefill attention")
    torch.manual_seed(0)
    q = (torch.randn(40, 9, 64) * 0.4).bfloat16()
    k, v = torch.randn(3, 60, 64).bfloat16(), torch.randn(3, 60, 64).bfloat16()
    out = ops.prefill_attention(q, k, v, 20)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, kernels.prefill_attention(q.float(), k, v, 20).bfloat16())
    torch.testing.assert_close(out.float(), _sdpa_at_offset(q.float(), k, v, 20), atol=1e-2, rtol=1e-2)


def test_prefill_attention_dispatch_falls_back_to_sdpa_where_it_does_not_apply():
    q, k = torch.randn(80, 9, 64, dtype=torch.float64), torch.randn(3, 80, 64, dtype=torch.float64)
    assert ops.prefill_attention(q, k, k, 0) is None  # a dtype the kernel does not take
    q, k = torch.randn(80, 9, 48), torch.randn(3, 80, 48)
    assert ops.prefill_attention(q, k, k, 0) is None  # a head size it does not take


def test_a_stale_build_lock_is_removed_a_fresh_one_kept(tmp_path):
    """A build killed midway leaves torch's lock file, and torch would wait on it forever."""
    import os
    import time

    from mcp2026.kernels.cpu import STALE_LOCK_S, clear_stale_lock

    assert not clear_stale_lock(tmp_path)  # no lock
    lock = tmp_path / "lock"
    lock.touch()
    assert not clear_stale_lock(tmp_path) and lock.exists()  # a build may be running
    old = time.time() - STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    assert clear_stale_lock(tmp_path) and not lock.exists()


def test_a_load_holds_the_folder_exclusively_and_its_holder_dying_frees_it(tmp_path):
    """The flock dies with its process (torch's lock file does not): a killed load never blocks the next one,
    and while one is held no other process gets it."""
    import subprocess
    import sys

    from mcp2026.kernels.cpu import _held_build_lock

    probe = (
        "import fcntl, sys; h = open(sys.argv[1], 'w')\n"
        "try:\n    fcntl.flock(h, fcntl.LOCK_EX | fcntl.LOCK_NB); print('free')\n"
        "except OSError:\n    print('held')"
    )
    path = str(tmp_path / ".mcp2026-load.lock")
    with _held_build_lock(tmp_path) as exclusive:
        assert exclusive
        assert (
            subprocess.run([sys.executable, "-c", probe, path], capture_output=True, text=True).stdout
            == "held\n"
        )
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, sys, time; h = open(sys.argv[1], 'w'); fcntl.flock(h, 2); "
            "print('ok', flush=True); time.sleep(60)",
            path,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline() == "ok\n"
    holder.kill()  # a load killed midway
    holder.wait()
    with _held_build_lock(tmp_path) as exclusive:  # does not wait: the kernel dropped the dead holder's lock
        assert exclusive


def test_a_built_module_loads_without_the_build_tooling(kernels):
    """Once built, a start imports the module file directly: torch's build tooling (setuptools, ninja's
    up-to-date check, ~0.1 s and 4 MB) is left out of the process."""
    import subprocess
    import sys

    code = (
        "import sys; from mcp2026.kernels import cpu; m = cpu.load(); "
        "print(m is not None, 'torch.utils.cpp_extension' in sys.modules)"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.stdout.split() == ["True", "False"], run.stderr


def test_a_built_file_that_does_not_load_is_removed_to_be_built_again(tmp_path):
    from mcp2026.kernels import cpu

    broken = tmp_path / "mcp2026_cpu_broken.so"
    broken.write_bytes(b"\x7fELF cut short by a killed link")
    assert cpu._import_built("mcp2026_cpu_broken", broken) is None
    assert not broken.exists()


def test_the_build_key_covers_the_compiler_flags(monkeypatch):
    from mcp2026.kernels import cpu

    key = cpu.build_key()
    monkeypatch.setattr(cpu, "CFLAGS", (*cpu.CFLAGS, "-DMCP_SOMETHING_ELSE"))
    assert cpu.build_key() != key


def test_sources_are_built_from_copies_in_the_build_folder(tmp_path):
    """Two checkouts of the same sources share one build: the build reads copies whose paths do not depend
    on the checkout, rewritten only when their contents change."""
    from mcp2026.kernels import cpu

    staged = cpu._stage_sources(tmp_path)
    assert [p.name for p in staged] == [p.name for p in cpu.SOURCES]
    for path in (*cpu.SOURCES, *cpu.HEADERS):
        assert (tmp_path / "src" / path.name).read_bytes() == path.read_bytes()
    first = staged[0].stat().st_mtime_ns
    cpu._stage_sources(tmp_path)
    assert staged[0].stat().st_mtime_ns == first  # unchanged contents: the build sees nothing new
    staged[0].write_text("stale")
    cpu._stage_sources(tmp_path)
    assert staged[0].read_bytes() == cpu.SOURCES[0].read_bytes()
    assert sorted(p.name for p in (tmp_path / "src").iterdir()) == sorted(
        p.name for p in (*cpu.SOURCES, *cpu.HEADERS)
    )  # no temporary files left behind
