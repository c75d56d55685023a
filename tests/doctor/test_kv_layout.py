"""KV layout: the engine's cache passes for plain and compressed KV; an insane block size, an interleaved
K/V layout and a read path that swaps K and V fail."""

from __future__ import annotations

import pytest
import torch

from mcp2026.config import EngineConfig, KVConfig
from mcp2026.doctor.context import DoctorContext
from mcp2026.doctor.kv_layout import check_block_size, check_cache_layout, check_kv_layout
from mcp2026.doctor.result import Status
from mcp2026.kv.compressor import KVCompressor
from mcp2026.kv.paged_cache import PagedKVCache
from mcp2026.pipeline import resolve_dtype


@pytest.mark.parametrize("dtype", [None, "int8", "fp8", "int4"])
def test_engine_cache_for_the_model_passes(tiny_llama_dir, dtype):
    compressor = KVCompressor(dtype=dtype, policy="none") if dtype else None
    ctx = DoctorContext(model=tiny_llama_dir, engine=EngineConfig(kv_compressor=compressor))
    block, layout = check_kv_layout(ctx)
    tokens = 32 if dtype == "int4" else 16  # int4's default block is its 32-token key group
    assert block.status is Status.PASS and block.details["blocks_per_sequence"] == 512 // tokens
    assert layout.status is Status.PASS, layout.reason
    plain = str(resolve_dtype("auto", None)).removeprefix("torch.")  # the model's dtype on this CPU
    assert layout.details["codec"] == (dtype or plain)


@pytest.mark.parametrize("block_size", [4, 48, 256])
def test_insane_block_sizes_fail(block_size):
    result = check_block_size(block_size, 4096)
    assert result.status is Status.FAIL and str(block_size) in result.reason


def test_block_larger_than_the_context_fails():
    assert check_block_size(64, 32).status is Status.FAIL
    assert check_block_size(16, 100).details["unused_slots_in_last_block"] == 12


def _cache() -> PagedKVCache:
    return PagedKVCache(num_layers=2, num_blocks=2, block_size=8, num_kv_heads=2, head_dim=4)


def test_interleaved_kv_layout_fails():
    cache = _cache()
    both = torch.zeros(2, 2, 2, 8, 2, 4)  # (L, blocks, heads, tokens, K|V, hd): K and V interleaved
    cache.k_planes = {"x": both[..., 0, :]}
    cache.v_planes = {"x": both[..., 1, :]}
    result = check_cache_layout(cache)
    assert result.status is Status.FAIL and "interleaved" in result.reason


def test_shared_kv_buffer_fails():
    cache = _cache()
    cache.v_planes = {"x": cache.k_planes["x"]}
    result = check_cache_layout(cache)
    assert result.status is Status.FAIL and "share memory" in result.reason


def test_a_read_path_that_swaps_k_and_v_fails():
    cache = _cache()
    gather = cache.gather
    cache.gather = lambda layer, read: tuple(reversed(gather(layer, read)))
    result = check_cache_layout(cache)
    assert result.status is Status.FAIL and "reads back wrong" in result.reason


def test_a_read_path_that_returns_token_major_tensors_fails():
    cache = _cache()
    gather = cache.gather
    cache.gather = lambda layer, read: tuple(x.transpose(1, 2) for x in gather(layer, read))
    result = check_cache_layout(cache)
    assert result.status is Status.FAIL and "attention expects" in result.reason


def test_unreadable_model_skips(tmp_path):
    (result,) = check_kv_layout(DoctorContext(model=tmp_path / "missing"))
    assert result.status is Status.SKIP


def test_engine_config_block_size_is_checked(tiny_llama_dir):
    ctx = DoctorContext(model=tiny_llama_dir, engine=EngineConfig(KVConfig(block_size=128)))
    block, layout = check_kv_layout(ctx)
    assert block.details["block_size"] == 128 and layout.status is Status.PASS
