"""The KV side of an engine, built once for a model and an ``EngineConfig``: the paged cache sized by the KV
budget, the block manager over it, the evictor a KV compressor asks for, and the context length they allow.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from mcp2026.config import EngineConfig, ModelConfig
from mcp2026.kv.evictor import KVEvictor
from mcp2026.kv.layer_weights import preset_name
from mcp2026.kv.manager import KVCacheManager
from mcp2026.kv.paged_cache import PagedKVCache
from mcp2026.kv.sizing import fitting_context, plan_kv_blocks

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineKV:
    config: EngineConfig  # the engine's config, with ``layer_weights="auto"`` resolved for the model
    max_model_len: int  # the longest sequence the engine runs (model, scheduler config and KV budget)
    cache: PagedKVCache
    manager: KVCacheManager
    evictor: KVEvictor | None
    # every layer slides (and nothing evicts): blocks behind the widest window are freed as sequences grow
    release_window: int | None


def build_engine_kv(
    config: EngineConfig,
    model_config: ModelConfig,
    max_positions: int,
    dtype: torch.dtype,
    device: torch.device,
) -> EngineKV:
    """The cache, manager and evictor for ``model_config`` (a model that holds ``max_positions`` positions)
    storing K/V in ``dtype`` on ``device``. Raises ValueError for eviction over sliding-window layers."""
    max_model_len = min(config.scheduler.max_model_len or model_config.max_position_embeddings, max_positions)
    config = _resolve_compressor(config, model_config)
    compressor = config.kv_compressor
    windows = [model_config.attention_window(i) for i in range(model_config.num_layers)]
    evicts = compressor is not None and compressor.evicts  # eviction fits long sequences itself
    if evicts and any(windows):
        raise ValueError(
            f"KV eviction policy {compressor.policy!r} with {model_config.architecture}'s sliding-window "
            "layers is not supported (the window reads positions, eviction renumbers them): use "
            "KVCompressor(policy='none'); the sliding layers already read only their window"
        )
    codec = compressor.make_codec() if compressor is not None else None
    kv = config.resolved_kv
    fits = fitting_context(kv, model_config, dtype, max_model_len, device, codec)
    if config.scheduler.max_model_len is None and not evicts and 0 < fits < max_model_len:
        log.warning(  # a long-context model (Gemma 3: 32k) on a small budget still runs, within the budget
            "the KV budget holds %d tokens, fewer than the model's %d-token context: sequences are capped at "
            "%d (set max_model_len, or a larger KV budget)", fits, max_model_len, fits,
        )  # fmt: skip
        max_model_len = fits
    num_blocks = plan_kv_blocks(
        kv, model_config, dtype, max_model_len, config.scheduler.max_num_seqs, device, codec
    )
    cache = PagedKVCache(
        model_config.num_layers,
        num_blocks,
        kv.block_size,
        model_config.num_kv_heads,
        model_config.head_dim,
        dtype,
        device=device,
        codec=codec,
        layered=compressor is not None and compressor.layer_weights is not None,
        **(
            {"max_error": compressor.max_error, "error_check_interval": compressor.error_check_interval}
            if compressor is not None
            else {}
        ),
    )
    manager = KVCacheManager(
        kv.block_size,
        num_blocks,
        num_shards=kv.max_kv_cache_shards,
        enable_prefix_caching=kv.enable_prefix_caching,
        max_parked_blocks=(
            None if kv.prefix_cache_gb is None else int(kv.prefix_cache_gb * 1e9 * num_blocks / cache.nbytes)
        ),
    )
    evictor = compressor.make_evictor(manager, max_model_len, cache) if compressor else None
    release_window = max(windows) if evictor is None and all(w is not None for w in windows) else None
    return EngineKV(config, max_model_len, cache, manager, evictor, release_window)


def _resolve_compressor(config: EngineConfig, model_config: ModelConfig) -> EngineConfig:
    """``config`` with its compressor's ``layer_weights="auto"`` resolved: this model's calibrated set, or
    uniform."""
    compressor = config.kv_compressor
    if compressor is None:
        return config
    resolved = compressor.for_model(model_config)
    if resolved.layer_weights is not None and resolved is not compressor:
        log.info(
            "KV per-layer budgets (layer_weights='auto'): %s, calibrated for this model and %s",
            preset_name(resolved.layer_weights) or "an installed calibration file",
            compressor.policy,
        )
    return replace(config, kv_compressor=resolved)
