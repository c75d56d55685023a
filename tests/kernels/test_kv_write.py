"""Quantize-on-write for the per-token KV codecs (kernels/kv_write.cpp): the bytes kv/codecs.py's encoders
store, bit for bit, written into the pool rows a plan names."""

from __future__ import annotations

import pytest
import torch

from mcp2026.kv.codecs import make_codec

KINDS = {"int8": 1, "fp8": 3}


def _planes(codec: str, rows: int, hd: int) -> list[torch.Tensor]:
    data = torch.full((rows, hd), 7, dtype=torch.uint8)  # not zero: untouched rows must stay as they were
    if codec == "fp8":
        data = data.view(torch.float8_e4m3fn)
    return [data] + [torch.full((rows,), 0.5, dtype=torch.half) for _ in range(2 if codec == "int8" else 1)]


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """(rows, bytes per row), whatever the plane's dtype."""
    return t.contiguous().view(torch.uint8).view(t.shape[0], -1)


def _rows(T: int, nkv: int, hd: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    magnitude = 10.0 ** torch.empty(T, nkv, 1).uniform_(-6, 4, generator=g)  # subnormal fp16 scales to large
    x = torch.randn(T, nkv, hd, generator=g) * magnitude + torch.randn(T, nkv, 1, generator=g) * magnitude * 3
    x[0, 0] = 0.0  # a row of zeros: the smallest scale
    x[1, -1] = x[1, -1].abs()  # all positive / all negative rows: zero points on either side of 0
    x[2, 0] = -x[2, 0].abs()
    # rows whose minimum is zero of both signs (which one a min returns varies): the zero point is +0 always
    x[3:7, 0] = x[3:7, 0].abs()
    x[3, 0, ::2], x[3, 0, 1::2] = 0.0, -0.0
    x[4, 0, ::2], x[4, 0, 1::2] = -0.0, 0.0
    x[5, 0, 1], x[6, 0, :3] = -0.0, torch.tensor([-0.0, -0.0, 0.0])
    return x.to(dtype)


@pytest.mark.parametrize("codec", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hd", [64, 12, 7])  # the 8-wide path, its scalar tail, scalar only
def test_written_rows_are_the_codecs_bytes(kernels, codec, dtype, hd):
    T, nkv, R = 40, 3, 300
    k, v = _rows(T, nkv, hd, dtype, seed=hd), _rows(T, nkv, hd, dtype, seed=hd + 1)
    rows = torch.randperm(R, generator=torch.Generator().manual_seed(0))[: T * nkv]
    kp, vp = _planes(codec, R, hd), _planes(codec, R, hd)
    before = [_as_bytes(p).clone() for p in kp]
    kernels.write_kv_rows_quantized(KINDS[codec], kp, vp, rows, k, v)
    tc = make_codec(codec).key
    for x, planes in ((k, kp), (v, vp)):
        for got, want in zip(planes, tc.encode(x).values(), strict=True):
            assert torch.equal(_as_bytes(got)[rows], _as_bytes(want.flatten(0, 1)))
    untouched = torch.ones(R, dtype=torch.bool)
    untouched[rows] = False
    for got, was in zip(kp, before, strict=True):
        assert torch.equal(_as_bytes(got)[untouched], was[untouched])


@pytest.mark.parametrize("codec", ["int8", "fp8"])
def test_a_nan_spoils_its_row_as_in_the_torch_encoder(kernels, codec):
    """A NaN anywhere in a row (not only first) makes the row's scale NaN, as torch's aminmax / amax do: the
    corruption stays visible instead of being clamped into the row's range."""
    k = torch.randn(4, 1, 16)
    k[0, 0, 5] = float("nan")
    k[1, 0, 0] = float("nan")
    k[2, 0, 3] = float("inf")
    v = -k
    rows = torch.arange(4)
    kp, vp = _planes(codec, 4, 16), _planes(codec, 4, 16)
    kernels.write_kv_rows_quantized(KINDS[codec], kp, vp, rows, k, v)
    for x, planes in ((k, kp), (v, vp)):
        encoded = make_codec(codec).key.encode(x)
        assert torch.equal(_as_bytes(planes[0]), _as_bytes(encoded["q"].flatten(0, 1)))
        for got, want in zip(planes[1:], list(encoded.values())[1:], strict=True):
            want = want.flatten()
            assert torch.equal(got.isnan(), want.isnan())  # NaN bit patterns are the conversion's business
            assert torch.equal(got[~want.isnan()], want[~want.isnan()])
    assert kp[1][:2].isnan().all()


def test_bad_input_is_rejected(kernels):
    k = v = torch.randn(2, 1, 8)
    kp, vp = _planes("int8", 4, 8), _planes("int8", 4, 8)
    rows = torch.tensor([0, 1])
    with pytest.raises(RuntimeError, match="kind"):
        kernels.write_kv_rows_quantized(2, kp, vp, rows, k, v)
    with pytest.raises(RuntimeError, match="outside the pool"):
        kernels.write_kv_rows_quantized(1, kp, vp, torch.tensor([0, 4]), k, v)
    with pytest.raises(RuntimeError, match="one entry per|T \\* nkv"):
        kernels.write_kv_rows_quantized(1, kp, vp, torch.tensor([0]), k, v)
    with pytest.raises(RuntimeError, match="takes 3 planes"):
        kernels.write_kv_rows_quantized(1, kp[:2], vp, rows, k, v)
    with pytest.raises(RuntimeError, match="codes must be"):
        kernels.write_kv_rows_quantized(3, _planes("int8", 4, 8)[:2], vp[:2], rows, k, v)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernels.write_kv_rows_quantized(1, kp, vp, rows, k.half(), v.half())


def _int4_planes(codec: str, chunks: int, bs: int, hd: int) -> tuple[list[torch.Tensor], int]:
    """Pool planes for one layer's K (``codec``'s key) or V, (chunks, ...), filled with 7s (untouched chunks
    must keep them), and the kernel's group argument (0: per-channel keys)."""
    tc = make_codec(codec.split(":")[0])
    tc = tc.key if codec.endswith(":k") else tc.value
    specs = tc.planes(bs, hd)
    planes = [torch.full((chunks, *specs[n].shape), 7, dtype=torch.uint8) for n in ("q", "scale", "zero")]
    planes.append(torch.full((chunks, 3), 0.5, dtype=torch.half))
    return planes, (0 if codec.endswith(":k") else tc._group(hd))


@pytest.mark.parametrize("codec", ["int4:k", "int4:v", "int4-g64:v"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("bs", "hd"), [(32, 64), (8, 64), (16, 12)])
def test_sealed_int4_blocks_are_the_codecs_bytes(kernels, codec, dtype, bs, hd):
    """kv_write.cpp's int4 seal stores exactly what Int4PerChannel / Int4PerTokenGroup.encode would, for
    blocks with tiny to large values, constant channels and constant blocks, into the chunks named."""
    ns, nkv, chunks = 5, 3, 24
    g = torch.Generator().manual_seed(bs + hd)
    magnitude = 10.0 ** torch.empty(ns, 1, nkv, 1).uniform_(-6, 3, generator=g)
    x = torch.randn(ns, bs, nkv, hd, generator=g) * magnitude + torch.randn(ns, 1, nkv, hd, generator=g)
    x[0, :, 0, 1] = 0.25  # a constant channel
    x[1, :, 1] = -1.5  # a constant block
    x[2, :, 2] = x[2, :, 2].abs()  # minimum zero, of both signs: zmin is +0 either way
    x[2, ::2, 2, 1], x[2, 1::2, 2, 1] = -0.0, 0.0
    x[2, 0, 2, 2:4], x[2, 3, 2, 6] = torch.tensor([0.0, -0.0]), -0.0
    x[3, :, 0] = 0.0  # all zeros
    x[3, 1::3, 0] = -0.0
    x[4, :, 1] = x[4, :, 1].abs()
    x[4, 2, 1, :3] = torch.tensor([-0.0, -0.0, 0.0])
    x = x.flatten(0, 1).to(dtype)
    planes, group = _int4_planes(codec, chunks, bs, hd)
    ids = torch.randperm(chunks, generator=g)[: ns * nkv]
    assert kernels.seal_int4_blocks(planes, ids, x, bs, group)
    tc = make_codec(codec.split(":")[0])
    tc = tc.key if codec.endswith(":k") else tc.value
    want = tc.encode(x.view(ns, bs, nkv, hd).transpose(1, 2).flatten(0, 1))
    untouched = torch.ones(chunks, dtype=torch.bool)
    untouched[ids] = False
    fill = _int4_planes(codec, chunks, bs, hd)[0]
    for got, name, was in zip(planes, ("q", "scale", "zero", "meta"), fill, strict=True):
        assert torch.equal(_as_bytes(got)[ids], _as_bytes(want[name])), name
        assert torch.equal(_as_bytes(got)[untouched], _as_bytes(was)[untouched])


def test_int4_seal_with_odd_value_groups(kernels):
    """A value group of 3 channels (head_dim 6; the codec allows any divisor): groups straddle the packed
    channel pairs."""
    from mcp2026.kv.codecs import Int4PerTokenGroup

    tc, bs, hd = Int4PerTokenGroup(3), 8, 6
    x = torch.randn(2 * bs, 1, hd, generator=torch.Generator().manual_seed(3))
    specs = tc.planes(bs, hd)
    planes = [torch.zeros((4, *specs[n].shape), dtype=specs[n].dtype) for n in ("q", "scale", "zero", "meta")]
    assert kernels.seal_int4_blocks(planes, torch.tensor([3, 1]), x, bs, 3)
    want = tc.encode(x.view(2, bs, 1, hd).transpose(1, 2).flatten(0, 1))
    for got, name in zip(planes, ("q", "scale", "zero", "meta"), strict=True):
        assert torch.equal(_as_bytes(got[[3, 1]]), _as_bytes(want[name])), name


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 7e4])
def test_int4_seal_leaves_nan_inf_and_beyond_fp16_to_the_torch_path(kernels, bad):
    """Blocks whose fp16 statistics would overflow: the kernel writes nothing and says so (the caller then
    encodes with torch, whose NaN bits it does not imitate)."""
    planes, _ = _int4_planes("int4:k", 4, 16, 64)
    before = [p.clone() for p in planes]
    x = torch.randn(16, 2, 64)
    x[5, 1, 9] = bad
    assert not kernels.seal_int4_blocks(planes, torch.tensor([0, 3]), x, 16, 0)
    assert all(torch.equal(a, b) for a, b in zip(planes, before, strict=True))
