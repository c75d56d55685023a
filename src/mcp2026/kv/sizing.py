"""How many KV blocks the pool gets: an explicit count, a size in GB, or a share of available memory."""

from __future__ import annotations

import torch

from mcp2026.config import KVConfig, ModelConfig
from mcp2026.hardware import available_memory_bytes
from mcp2026.kv.codecs import KVCodec, identity_codec


def kv_block_bytes(
    model: ModelConfig, block_size: int, dtype: torch.dtype, codec: KVCodec | None = None
) -> int:
    """Bytes of one block, all layers, K and V, as ``codec`` (default: ``dtype`` as is) stores it."""
    codec = codec or identity_codec(dtype)
    return model.num_layers * codec.block_bytes(block_size, model.num_kv_heads, model.head_dim)


def kv_bytes_per_token(
    model: ModelConfig, dtype: torch.dtype, codec: KVCodec | None = None, block_size: int = 16
) -> float:
    return kv_block_bytes(model, block_size, dtype, codec) / block_size


def available_device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return available_memory_bytes()


def _budget_bytes(kv: KVConfig, device: torch.device | None) -> float:
    if kv.memory_gb is not None:
        return kv.memory_gb * 1e9
    return kv.memory_fraction * available_device_memory(device or torch.device("cpu"))


def fitting_context(
    kv: KVConfig,
    model: ModelConfig,
    dtype: torch.dtype,
    max_model_len: int,
    device: torch.device | None = None,
    codec: KVCodec | None = None,
) -> int:
    """The longest sequence, up to ``max_model_len``, whose blocks a budget in bytes holds (whole blocks); a pool
    given as a block count is its owner's to size (``max_model_len`` back)."""
    if kv.num_blocks is not None:
        return max_model_len
    num_blocks = int(_budget_bytes(kv, device) // kv_block_bytes(model, kv.block_size, dtype, codec))
    return min(max_model_len, num_blocks * kv.block_size)


def plan_kv_blocks(
    kv: KVConfig,
    model: ModelConfig,
    dtype: torch.dtype,
    max_model_len: int,
    max_num_seqs: int,
    device: torch.device | None = None,
    codec: KVCodec | None = None,
) -> int:
    """Blocks for the budget, never fewer than one full-length sequence needs, never more than
    ``max_num_seqs`` (the scheduler's) full-length sequences could use (a larger pool would only reserve
    address space).
    A quantizing ``codec`` stores fewer bytes per block, so the same budget buys more blocks."""
    if kv.num_blocks is not None:
        return kv.num_blocks
    block_bytes = kv_block_bytes(model, kv.block_size, dtype, codec)
    budget = _budget_bytes(kv, device)
    blocks_per_seq = -(-max_model_len // kv.block_size)
    num_blocks = int(budget // block_bytes)
    if num_blocks < blocks_per_seq:
        raise ValueError(
            f"KV budget of {budget / 1e9:.2f} GB holds {num_blocks * kv.block_size} tokens, fewer than one "
            f"{max_model_len}-token sequence; raise KVConfig.memory_gb or lower max_model_len"
        )
    return min(num_blocks, blocks_per_seq * max_num_seqs)
