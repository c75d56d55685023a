"""The Triton kernels (kernels/gpu_*.py) against the torch ops they replace, run by Triton's interpreter on
CPU tensors (fp32 and fp16: the interpreter computes through numpy, which has no bf16)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

# before triton is imported and the kernels are defined: they become interpreted functions
os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from mcp2026.kernels import gpu_attention, gpu_fused  # noqa: E402
from mcp2026.models.rotary import RotaryEmbedding  # noqa: E402

DTYPES = [torch.float32, torch.float16]


def _tol(dtype: torch.dtype) -> dict:
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-3, "rtol": 2e-3}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_x", [True, False])
def test_add_rms_norm_matches_torch(dtype, with_x):
    g = torch.Generator().manual_seed(0)
    residual = torch.randn(5, 96, generator=g).to(dtype)
    x = torch.randn(5, 96, generator=g).to(dtype) if with_x else None
    weight = torch.rand(96, generator=g).to(dtype) + 0.5
    expected_res = residual + x if with_x else residual.clone()
    expected = F.rms_norm(expected_res.float(), (96,), weight.float(), 1e-5)
    out = gpu_fused.add_rms_norm(residual, x, weight, 1e-5)
    assert torch.equal(residual, expected_res)  # updated in place, rounded like torch's add
    torch.testing.assert_close(out.float(), expected, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_torch(dtype):
    gate_up = torch.randn(3, 2 * 1500, generator=torch.Generator().manual_seed(1)).to(dtype)
    gate, up = gate_up.float().chunk(2, dim=-1)
    torch.testing.assert_close(gpu_fused.silu_mul(gate_up).float(), F.silu(gate) * up, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_in_place_matches_torch_on_a_strided_view(dtype):
    rope = RotaryEmbedding(32, 64, 10000.0, None)
    positions = torch.tensor([0, 5, 17, 63])
    qkv = torch.randn(4, 7 * 32 + 40, generator=torch.Generator().manual_seed(2)).to(dtype)
    qk = qkv[:, : 7 * 32].view(4, 7, 32)  # rows strided by the fused qkv width
    cos, sin = rope.table(positions, torch.float32)
    expected = rope.apply(qk.float(), cos, sin)
    tail = qkv[:, 7 * 32 :].clone()
    gpu_fused.rope_(qk, cos.to(dtype), sin.to(dtype))
    torch.testing.assert_close(qk.float(), expected, **_tol(dtype))
    assert torch.equal(qkv[:, 7 * 32 :], tail)  # the v columns are not touched


@pytest.mark.parametrize("head_dim,rotary_dim", [(96, None), (32, 24)], ids=["half-48", "partial-rotary"])
def test_rope_with_a_half_that_is_not_a_power_of_two(head_dim, rotary_dim):
    rope = RotaryEmbedding(head_dim, 64, 10000.0, None, rotary_dim)
    positions = torch.tensor([0, 5, 17, 63])
    qk = torch.randn(4, 6, head_dim, generator=torch.Generator().manual_seed(4))
    cos, sin = rope.table(positions, torch.float32)
    expected = rope.apply(qk, cos, sin)
    gpu_fused.rope_(qk, cos, sin)
    torch.testing.assert_close(qk, expected, **_tol(torch.float32))


def test_write_kv_rows_scatters_strided_tokens():
    nkv, hd = 2, 16
    k_rows = torch.full((40, hd), float("nan"))
    v_rows = torch.full((40, hd), float("nan"))
    kv = torch.randn(3, 2 * nkv * hd + 8, generator=torch.Generator().manual_seed(3))
    k = kv[:, : nkv * hd].view(3, nkv, hd)
    v = kv[:, nkv * hd : 2 * nkv * hd].view(3, nkv, hd)
    rows = torch.tensor([7, 8, 20, 21, 33, 2])
    gpu_fused.write_kv_rows(k_rows, v_rows, rows, k, v)
    torch.testing.assert_close(k_rows[rows], k.reshape(-1, hd))
    torch.testing.assert_close(v_rows[rows], v.reshape(-1, hd))
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[rows] = False
    assert k_rows[untouched].isnan().all() and v_rows[untouched].isnan().all()


def _reference_decode(q, k_cache, v_cache, tables, lengths):
    """Plain softmax attention over each sequence's first ``length`` tokens, gathered through its table."""
    out = []
    nh, nkv = q.shape[1], k_cache.shape[1]
    for b in range(q.shape[0]):
        n = int(lengths[b])
        k = k_cache[tables[b]].transpose(0, 1).flatten(1, 2)[:, :n].float()  # (nkv, n, hd)
        v = v_cache[tables[b]].transpose(0, 1).flatten(1, 2)[:, :n].float()
        k, v = k.repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)
        probs = torch.softmax(q[b].float().unsqueeze(1) @ k.transpose(-1, -2), dim=-1)
        out.append((probs @ v).squeeze(1))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [1, 3, 16])
def test_paged_decode_attention_matches_reference(dtype, splits):
    g = torch.Generator().manual_seed(4)
    num_blocks, nkv, bs, hd, nh = 40, 3, 16, 32, 9
    k_cache = torch.randn(num_blocks, nkv, bs, hd, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, nkv, bs, hd, generator=g).to(dtype)
    lengths = torch.tensor([1, 16, 17, 150, 97])
    width = 10
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:width] for _ in lengths])
    q = (torch.randn(len(lengths), nh, hd, generator=g) / hd**0.5).to(dtype)
    out = gpu_attention.paged_decode_attention(q, k_cache, v_cache, tables, lengths, splits=splits)
    expected = _reference_decode(q, k_cache, v_cache, tables, lengths)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("codec_name,kind", [("int8", 1), ("fp8", 3)])
def test_paged_decode_attention_reads_quantized_blocks(dtype, codec_name, kind):
    """int8 / fp8 KV blocks as the codecs store them, decoded by the kernel as it reads them: the same
    attention as over the codec's own decoding of the blocks (which is what the quantization costs)."""
    from mcp2026.kv.codecs import Fp8PerToken, Int8PerToken

    codec = {"int8": Int8PerToken, "fp8": Fp8PerToken}[codec_name]()
    g = torch.Generator().manual_seed(5)
    num_blocks, nkv, bs, hd, nh = 24, 2, 16, 32, 8
    planes_k = codec.encode(torch.randn(num_blocks, nkv, bs, hd, generator=g) * 3)
    planes_v = codec.encode(torch.randn(num_blocks, nkv, bs, hd, generator=g))
    lengths = torch.tensor([1, 33, 120, 64])
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:8] for _ in lengths])
    q = (torch.randn(len(lengths), nh, hd, generator=g) / hd**0.5).to(dtype)
    names = ["q", *gpu_attention.QUANTIZED_KINDS[kind][1]]
    out = gpu_attention.paged_decode_attention_quantized(
        q, kind, [planes_k[n] for n in names], [planes_v[n] for n in names], tables, lengths, splits=3
    )
    k_float, v_float = codec.decode(planes_k, torch.float32), codec.decode(planes_v, torch.float32)
    expected = _reference_decode(q, k_float, v_float, tables, lengths)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, **_tol(dtype))


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_quantized_decode_reads_a_live_cache_as_the_cpu_kernel_does(tmp_path, dtype):
    """The planes a PagedKVCache hands the decode step (its own layout and strides, written by a real
    generation) read by the GPU kernel give the CPU kernel's attention."""
    from mcp2026.config import EngineConfig, KVConfig
    from mcp2026.engine.engine import LLMEngine
    from mcp2026.kernels import ops
    from mcp2026.kv.compressor import KVCompressor
    from mcp2026.loading.loader import load_model
    from mcp2026.types import SamplingParams

    from conftest import save_tiny_hf

    tiny = load_model(save_tiny_hf(tmp_path, max_position_embeddings=256))
    config = EngineConfig(KVConfig(block_size=16, num_blocks=32), kv_compressor=KVCompressor(dtype=dtype))
    engine = LLMEngine(tiny.model, tiny.config, None, config)
    engine.generate([list(range(3, 40)), list(range(50, 70))], SamplingParams(max_tokens=4, ignore_eos=True))
    cache = engine.cache
    assert cache.quantized_kernel_kind in (1, 3)
    g = torch.Generator().manual_seed(8)
    nh, hd = tiny.config.num_heads, cache.head_dim
    q = torch.randn(2, nh, hd, generator=g) / hd**0.5
    tables = torch.tensor([[0, 1, 2], [3, 4, 0]])
    lengths = torch.tensor([40, 23])
    for layer in range(cache.num_layers):
        kp, vp, sk, sv = cache.layer_planes(layer)
        expected = ops.paged_decode_attention_quantized(
            q, cache.quantized_kernel_kind, kp, vp, sk, sv, tables, lengths
        )
        out = gpu_attention.paged_decode_attention_quantized(
            q, cache.quantized_kernel_kind, kp, vp, tables, lengths
        )
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_quantized_decode_refuses_planes_it_cannot_read():
    q = torch.zeros(1, 2, 16)
    data = torch.zeros(4, 1, 16, 16, dtype=torch.uint8)
    scale = torch.zeros(4, 1, 16, dtype=torch.float16)
    tables, lengths = torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long)
    with pytest.raises(ValueError, match="kind 2"):
        gpu_attention.paged_decode_attention_quantized(q, 2, [data], [data], tables, lengths)
    with pytest.raises(ValueError, match="scale, zero"):
        gpu_attention.paged_decode_attention_quantized(q, 1, [data, scale], [data, scale], tables, lengths)
    with pytest.raises(ValueError, match="fp16"):
        wrong = [data, scale.float(), scale]
        gpu_attention.paged_decode_attention_quantized(q, 1, wrong, wrong, tables, lengths)


def test_split_count_follows_the_batch():
    assert gpu_attention.num_splits(1, 3, 132) == gpu_attention.MAX_SPLITS
    assert gpu_attention.num_splits(256, 3, 132) == 1
    assert 1 <= gpu_attention.num_splits(16, 3, 132) <= gpu_attention.MAX_SPLITS
    assert gpu_attention.num_splits(8, 3, 16) < gpu_attention.num_splits(8, 3, 132)  # a smaller GPU, fewer


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 5, 70])
def test_int8_matmul_matches_dequantized_weights(dtype, m):
    from mcp2026.kernels import gpu_int8

    g = torch.Generator().manual_seed(6)
    weight = torch.randint(-127, 128, (100, 96), generator=g, dtype=torch.int8)
    scales = torch.rand(100, generator=g) / 100
    x = torch.randn(m, 96, generator=g).to(dtype)
    expected = x.float() @ (weight.float() * scales[:, None]).t()
    out = gpu_int8.int8_matmul(x, weight, scales)
    assert out.shape == (m, 100) and out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, **_tol(dtype))


@pytest.mark.parametrize(("capability", "kinds"), [((8, 0), (1,)), ((8, 9), (1, 3)), ((9, 0), (1, 3))])
def test_fp8_kv_blocks_are_read_where_the_gpu_converts_e4m3(monkeypatch, capability, kinds):
    from mcp2026.kernels import gpu

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert gpu.quantized_kv_kinds.__wrapped__(torch.device("cuda", 0)) == kinds
    assert gpu.quantized_kv_kinds(torch.device("cpu")) == ()
