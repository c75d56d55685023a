"""KV codecs: round-trip error bounds, shapes, bytes per token, and the budget buying more blocks."""

from __future__ import annotations

import pytest
import torch

from mcp2026.config import KVConfig, ModelConfig
from mcp2026.kv.codecs import CODECS, coded_affine_params, decode_affine_params, make_codec
from mcp2026.kv.sizing import kv_bytes_per_token, plan_kv_blocks

BS, NKV, HD = 16, 2, 64


def blocks(n: int = 6, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, BS, NKV, HD, generator=g) * 2 + 0.5
    x[0, :, :, 3] += 20.0  # an outlier channel (keys have them)
    x[1] = 0.0  # all zeros: finite, exact
    x[2, :, 1] = 1.25  # a constant row
    return x


@pytest.mark.parametrize("name", sorted(CODECS))
def test_round_trip_keeps_shape_and_is_finite(name):
    codec = make_codec(name)
    x = blocks().transpose(1, 2).flatten(0, 1)  # (blocks * heads, bs, hd) chunks
    for tc in (codec.key, codec.value):
        y = tc.decode(tc.encode(x), torch.float32)
        assert y.shape == x.shape and torch.isfinite(y).all()
        assert torch.equal(y[NKV : 2 * NKV], x[NKV : 2 * NKV])  # zeros survive every codec


def test_identity_codecs():
    x = blocks()
    assert torch.equal(make_codec("fp32").key.decode(make_codec("fp32").key.encode(x), torch.float32), x)
    for name, rel in (("bf16", 2**-8), ("fp16", 2**-11)):
        tc = make_codec(name).key
        y = tc.decode(tc.encode(x), torch.float32)
        assert ((y - x).abs() <= x.abs() * rel + 1e-6).all()


def test_int8_error_within_half_a_step():
    tc = make_codec("int8").key
    x = blocks()
    planes = tc.encode(x)
    assert planes["q"].dtype == torch.uint8 and planes["scale"].shape == (6, BS, NKV)
    y = tc.decode(planes, torch.float32)
    step = planes["scale"].float().unsqueeze(-1)
    assert ((y - x).abs() <= step / 2 * 1.001 + 1e-6).all()
    assert (y[2, :, 1] - 1.25).abs().max() < 1e-3  # constant rows decode to themselves


def test_fp8_relative_error():
    tc = make_codec("fp8").key
    x = blocks()
    planes = tc.encode(x)
    assert planes["q"].dtype == torch.float8_e4m3fn
    y = tc.decode(planes, torch.float32)
    scale = planes["scale"].float().unsqueeze(-1)
    assert ((y - x).abs() <= x.abs() * 2**-4 + scale * 2**-9).all()  # 3 mantissa bits; subnormals


def _within_half_a_step(tc, x: torch.Tensor, slack: float = 1e-6) -> bool:
    """Every value of the int4 round trip of chunks x (N, bs, hd) within half its decoded step."""
    planes = tc.encode(x)
    step = decode_affine_params(planes, torch.float32)[0]  # keys (N, hd); values (N, bs, groups)
    step = step.unsqueeze(1) if step.dim() == 2 else step.repeat_interleave(x.shape[-1] // step.shape[-1], -1)
    return bool(((tc.decode(planes, torch.float32) - x).abs() <= step / 2 * 1.001 + slack).all())


def test_int4_keys_per_channel_values_per_group():
    codec = make_codec("int4")
    assert codec.is_staged and not codec.key.is_per_token and not codec.value.is_per_token
    x = blocks().transpose(1, 2).flatten(0, 1)  # (blocks * heads, bs, hd) chunks
    kp = codec.key.encode(x)
    assert (
        kp["scale"].shape == (6 * NKV, HD) and kp["scale"].dtype == torch.uint8
    )  # per (block, head, channel)
    assert kp["meta"].shape == (6 * NKV, 3) and kp["meta"].dtype == torch.float16
    assert _within_half_a_step(codec.key, x)
    vp = codec.value.encode(x)
    assert vp["scale"].shape == (6 * NKV, BS, HD // 32)  # per token, groups of 32 channels
    assert _within_half_a_step(codec.value, x)
    # Per-channel keys isolate the outlier channel: the other channels keep a fine grid.
    err_keys = (codec.key.decode(kp, torch.float32) - x)[:NKV, :, 4].abs().max()
    err_tok = (codec.value.decode(codec.value.encode(x), torch.float32) - x)[:NKV, :, 4].abs().max()
    assert err_keys < err_tok


@pytest.mark.parametrize("seed", range(20))
def test_coded_params_cover_every_group(seed):
    """uint8-coded scales and zeros: zero <= min and zero + 15 * scale >= max in every group, whatever the
    spread of groups in a chunk (outliers, tiny ranges, constants, large offsets)."""
    g = torch.Generator().manual_seed(seed)
    n, groups = 8, 64
    center = torch.randn(n, groups, generator=g) * 10 ** torch.empty(n, 1).uniform_(-3, 3, generator=g)
    width = torch.rand(n, groups, generator=g) * 10 ** torch.empty(n, groups).uniform_(-4, 2, generator=g)
    width[:, :3] = 0.0  # constant groups
    lo, hi = center - width, center + width
    scale, zero, planes = coded_affine_params(lo, hi, 15)
    assert (zero <= lo).all() and (zero + 15 * scale >= hi).all()
    assert planes["scale"].dtype == planes["zero"].dtype == torch.uint8 and (planes["scale"] >= 1).all()
    s2, z2 = decode_affine_params(planes, torch.float32)
    assert torch.equal(s2, scale) and torch.equal(z2, zero)  # decode computes exactly what encode used
    # the codes cost little: each scale is at most 1/254 of the chunk's largest step above what it needs
    need = (hi - zero) / 15
    assert (scale - need <= need.amax(1, keepdim=True) / 254 * 1.01 + 2.0**-14).all()


def test_int4_error_bound_holds_on_random_chunks():
    for seed in range(10):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(12, BS, HD, generator=g) * torch.rand(12, 1, HD, generator=g) * 30
        x += torch.randn(12, 1, HD, generator=g) * 5  # per-channel offsets, as keys have
        for tc in (make_codec("int4").key, make_codec("int4").value, make_codec("int4-g64").value):
            assert _within_half_a_step(tc, x, slack=1e-5)


def test_bytes_per_token():
    per_layer = {name: make_codec(name).bytes_per_token(BS, NKV, HD) for name in CODECS}
    elems = NKV * HD
    assert per_layer["fp32"] == 2 * 4 * elems and per_layer["bf16"] == 2 * 2 * elems
    assert per_layer["int8"] == 2 * (elems + 4 * NKV)  # + fp16 scale and zero per (token, head)
    assert per_layer["fp8"] == 2 * (elems + 2 * NKV)
    meta = 6 * NKV / BS  # three fp16 per (block, head) for K and for V
    keys = elems / 2 + 2 * elems / BS + meta  # nibbles + uint8 scale/zero codes per channel per block
    values = elems / 2 + 2 * NKV * HD / 32 + meta  # ... per (token, group of 32)
    assert per_layer["int4"] == keys + values
    assert per_layer["bf16"] / per_layer["int4"] > 3.3
    assert make_codec("int4").bytes_per_token(32, NKV, HD) < per_layer["int4"]  # bigger key groups


def test_budget_buys_proportionally_more_blocks():
    model = ModelConfig("llama", 320, 64, 128, 4, 4, 2, 32, max_position_embeddings=256)
    kv = KVConfig(block_size=16, memory_gb=0.01)
    counts = {
        name: plan_kv_blocks(kv, model, torch.float32, 256, max_num_seqs=10**6, codec=make_codec(name))
        for name in ("fp32", "int8", "int4")
    }
    bpt = {name: kv_bytes_per_token(model, torch.float32, make_codec(name)) for name in counts}
    for name in counts:
        assert abs(counts[name] * bpt[name] * 16 - 0.01e9) <= bpt[name] * 16
    assert counts["int8"] > 3 * counts["fp32"] and counts["int4"] > 5 * counts["fp32"]


def test_unknown_codec():
    with pytest.raises(ValueError, match="unknown KV codec 'int3'"):
        make_codec("int3")


def test_int4_rejects_odd_head_dim():
    with pytest.raises(ValueError, match="head_dim"):
        make_codec("int4").check_shape(2, 48)


def test_int4_g64_values_halve_the_scale_bytes():
    codec = make_codec("int4-g64")
    hd = 64  # SmolLM2's head_dim; groups of 64 need head_dim >= 64
    x = torch.randn(4, 16, hd)
    vp = codec.value.encode(x)
    assert vp["scale"].shape == (4, 16, 1)
    assert _within_half_a_step(codec.value, x)  # one step per token and head
    # SmolLM2 (3 KV heads x 64): bytes per token and layer, bf16 768; int4 at 16-token blocks 230.25 (3.34x
    # fewer), at 32 217.1 (3.54x); int4-g64 at 64-token blocks 204.6 (3.75x)
    assert make_codec("bf16").bytes_per_token(64, 3, hd) == 768
    assert make_codec("int4-g64").bytes_per_token(64, 3, hd) == 3 * (
        32 + 2 / 64 * 64 + 6 / 64 + 32 + 2 + 6 / 64
    )
    assert make_codec("int4").bytes_per_token(16, 3, hd) == 230.25
    assert 768 / make_codec("int4").bytes_per_token(32, 3, hd) > 3.5
