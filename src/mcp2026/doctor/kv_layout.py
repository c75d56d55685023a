"""KV layout section: the paged cache the engine would build for this model stores K and V in separate,
contiguous head-major planes, and reads come back as the (B, nkv, tokens, head_dim) tensors the attention
path (models/attention.py) multiplies; the block size is a power of two in [8, 128] that fits the context.

The layout check is functional: it writes known K and V through the cache's codec into two blocks mapped in
reverse order, gathers them back and compares, so a swapped, interleaved or mis-strided layout shows up.
"""

from __future__ import annotations

import torch

from mcp2026.doctor.context import DoctorContext
from mcp2026.doctor.result import CheckResult, failed, passed
from mcp2026.kv.codecs import describe_default_block_sizes
from mcp2026.kv.paged_cache import PagedKVCache
from mcp2026.loading.loader import MAX_ROPE_POSITIONS

MIN_BLOCK, MAX_BLOCK = 8, 128
LOSSY_TOLERANCE = 0.1  # max |error| / max |value| a lossy KV codec may show on random data


def check_block_size(block_size: int, max_model_len: int) -> CheckResult:
    name = "block size"
    fix = (
        f"set kv.block_size to a power of two in [{MIN_BLOCK}, {MAX_BLOCK}] (default: the KV codec's, "
        f"{describe_default_block_sizes()})"
    )
    if not (MIN_BLOCK <= block_size <= MAX_BLOCK and block_size & (block_size - 1) == 0):
        return failed(
            name, f"block size {block_size} is not a power of two in [{MIN_BLOCK}, {MAX_BLOCK}]", fix
        )
    if block_size > max_model_len:
        return failed(name, f"block size {block_size} exceeds the {max_model_len}-token context", fix)
    blocks = -(-max_model_len // block_size)
    return passed(
        name,
        f"{block_size} tokens per block; a full {max_model_len}-token sequence takes {blocks} blocks",
        block_size=block_size,
        blocks_per_sequence=blocks,
        unused_slots_in_last_block=blocks * block_size - max_model_len,
    )


def _storages_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    sa, sb = a.untyped_storage(), b.untyped_storage()
    a0, b0 = sa.data_ptr(), sb.data_ptr()
    return a0 < b0 + sb.nbytes() and b0 < a0 + sa.nbytes()


def _structure_problem(cache: PagedKVCache) -> str | None:
    """Planes must be contiguous (L, num_blocks, nkv, *chunk) tensors, K's apart from V's."""
    expected = (cache.num_layers, cache.num_blocks, cache.num_kv_heads)
    for kind, planes, codec in (
        ("K", cache.k_planes, cache.codec.key),
        ("V", cache.v_planes, cache.codec.value),
    ):
        specs = codec.planes(cache.block_size, cache.head_dim)
        for plane_name, plane in planes.items():
            shape = (*expected, *specs[plane_name].shape)
            if tuple(plane.shape) != shape:
                return f"{kind} plane {plane_name!r} has shape {tuple(plane.shape)}, expected {shape}"
            if not plane.is_contiguous():
                return f"{kind} plane {plane_name!r} is not contiguous (strides {plane.stride()}): K/V interleaved?"
    for kn, k in cache.k_planes.items():
        for vn, v in cache.v_planes.items():
            if _storages_overlap(k, v):
                return f"K plane {kn!r} and V plane {vn!r} share memory: an interleaved K/V layout"
    return None


def _round_trip_problem(cache: PagedKVCache) -> str | None:
    """Write two full blocks of known K and V (block table [1, 0]) to the first and last layer, read back."""
    bs, nkv, hd = cache.block_size, cache.num_kv_heads, cache.head_dim
    tokens, table = 2 * bs, [1, 0]
    generator = torch.Generator().manual_seed(0)
    plan = cache.plan_write([("doctor", 0, tokens, table)])
    layers = sorted({0, cache.num_layers - 1})
    written = {}
    for layer in layers:
        k = torch.randn(tokens, nkv, hd, generator=generator).to(cache.dtype) + layer
        v = -torch.randn(tokens, nkv, hd, generator=generator).to(cache.dtype) - 3 - layer
        cache.write(layer, plan, k, v)
        written[layer] = (k, v)
    cache.commit(plan)
    read = cache.block_read(torch.tensor([table]))
    expected_shape = (1, nkv, tokens, hd)
    for layer, (k, v) in written.items():
        for kind, got, want in zip("KV", cache.gather(layer, read), (k, v)):
            if tuple(got.shape) != expected_shape or got.dtype != cache.dtype or got.stride(-1) != 1:
                return (
                    f"layer {layer} {kind} reads back as {tuple(got.shape)} {got.dtype} strides {got.stride()}; "
                    f"attention expects {expected_shape} {cache.dtype} with unit stride over head_dim"
                )
            error = (got[0].transpose(0, 1).float() - want.float()).abs().max().item()
            scale = want.float().abs().max().item()
            limit = 0.0 if cache.codec.is_lossless else LOSSY_TOLERANCE * scale
            if error > limit:
                return f"layer {layer} {kind} reads back wrong (max error {error:.3g}, allowed {limit:.3g})"
    return None


def check_cache_layout(cache: PagedKVCache) -> CheckResult:
    name = "cache layout"
    problem = _structure_problem(cache) or _round_trip_problem(cache)
    details = {
        "codec": cache.codec.name,
        "k_planes": {n: list(p.shape) for n, p in cache.k_planes.items()},
        "v_planes": {n: list(p.shape) for n, p in cache.v_planes.items()},
    }
    if problem is not None:
        return failed(
            name, problem, "the KV cache and the attention path disagree: a bug, report it", **details
        )
    return passed(
        name,
        f"{cache.codec.name} K and V in separate head-major planes {details['k_planes']}; a write and "
        "read-back through two reversed blocks matches",
        **details,
    )


def build_cache(ctx: DoctorContext, num_blocks: int = 2) -> PagedKVCache:
    """The engine's cache for this model and engine config, with only ``num_blocks`` blocks."""
    cfg, engine = ctx.model_config(), ctx.engine
    compressor = engine.kv_compressor
    extra = (
        {"max_error": compressor.max_error, "error_check_interval": compressor.error_check_interval}
        if compressor is not None
        else {}
    )
    return PagedKVCache(
        cfg.num_layers,
        num_blocks,
        engine.block_size,
        cfg.num_kv_heads,
        cfg.head_dim,
        ctx.activation_dtype,
        device=ctx.device,
        codec=compressor.make_codec() if compressor is not None else None,
        **extra,
    )


def check_kv_layout(ctx: DoctorContext) -> list[CheckResult]:
    if (skip := ctx.needs_model("cache layout")) is not None:
        return [skip]
    cfg = ctx.model_config()
    max_len = min(ctx.engine.scheduler.max_model_len or cfg.max_position_embeddings, MAX_ROPE_POSITIONS)
    return [check_block_size(ctx.engine.block_size, max_len), check_cache_layout(build_cache(ctx))]
