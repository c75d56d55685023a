"""Debug checks for KV compression: shapes unchanged by a codec, round-trip error per
layer against a relative threshold (``max_error``), and pool fragmentation. ``LLMEngine.kv_debug_report()``
collects them; ``mcp2026 doctor`` reads that report.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from mcp2026.kv.codecs import Planes, TensorCodec
from mcp2026.kv.manager import KVCacheManager

log = logging.getLogger(__name__)
KINDS = ("k", "v")


class ErrorMonitor:
    """Relative round-trip error ``||x_hat - x|| / ||x||`` per layer, K and V, measured on the writes of
    every ``interval``-th step (the rest cost nothing). Errors above ``max_error`` are counted per layer and
    kind; the first one is logged, once per cache (one line per layer flooded the log: int4 values sit near
    0.08 in every layer), and the report lists them all."""

    def __init__(self, num_layers: int, codec_name: str, max_error: float = 0.02, interval: int = 16) -> None:
        self.num_layers = num_layers
        self.codec_name = codec_name
        self.max_error = max_error
        self.interval = interval
        self.max = torch.zeros(2, num_layers)
        self.sum = torch.zeros(2, num_layers)
        self.num_checks = torch.zeros(2, num_layers, dtype=torch.long)
        self.num_over = torch.zeros(2, num_layers, dtype=torch.long)
        self.num_shape_checks = 0
        self._num_steps = 0
        self._warned = False

    def is_due(self) -> bool:
        """Call once per step: whether this step's writes are measured."""
        self._num_steps += 1
        return (self._num_steps - 1) % self.interval == 0

    def record(self, layer: int, kind: int, codec: TensorCodec, encoded: Planes, x: torch.Tensor) -> None:
        decoded = codec.decode(encoded, torch.float32)
        if decoded.shape != x.shape:
            raise AssertionError(
                f"KV codec {codec.name} changed a shape: {tuple(x.shape)} -> {tuple(decoded.shape)}"
            )
        self.num_shape_checks += 1
        x = x.float()
        error = float((decoded - x).norm() / x.norm().clamp_min(1e-12))
        self.max[kind, layer] = max(float(self.max[kind, layer]), error)
        self.sum[kind, layer] += error
        self.num_checks[kind, layer] += 1
        if error > self.max_error:
            self.num_over[kind, layer] += 1
            if not self._warned:
                self._warned = True
                log.warning(
                    "KV %s of layer %d: %s round-trip error %.4f exceeds max_error %.4f (logged once; every "
                    "layer over it is in kv_debug_report()['layers_over_max_error']). int4 and fp8 keys measure "
                    "0.02-0.08 on SmolLM2 by design: raise KVCompressor.max_error above that to flag only outliers",
                    "keys" if kind == 0 else "values",
                    layer,
                    self.codec_name,
                    error,
                    self.max_error,
                )

    def report(self) -> dict[str, Any]:
        mean = (self.sum / self.num_checks.clamp_min(1)).tolist()
        over = [
            {"layer": layer, "kind": KINDS[kind], "max_error": float(self.max[kind, layer])}
            for kind in (0, 1)
            for layer in range(self.num_layers)
            if self.num_over[kind, layer] > 0
        ]
        return {
            "max_error_threshold": self.max_error,
            "num_error_checks": int(self.num_checks.sum()),
            "num_shape_checks": self.num_shape_checks,
            "k_error_max": self.max[0].tolist(),
            "v_error_max": self.max[1].tolist(),
            "k_error_mean": mean[0],
            "v_error_mean": mean[1],
            "layers_over_max_error": over,
        }


def fragmentation_report(manager: KVCacheManager, num_computed: Mapping[str, int]) -> dict[str, Any]:
    """Pool fragmentation: slots held but empty (partial last blocks) and how scattered the free ids are.
    ``num_computed``: tokens with KV of each request holding blocks."""
    pool, bs = manager.pool, manager.block_size
    tokens_in_block: dict[int, int] = {}
    num_dropped = 0  # blocks of KV evicted (their slots went back to the pool)
    for rid, n in num_computed.items():
        dropped = manager.num_dropped_tokens(rid)
        num_dropped += dropped // bs
        for i, b in enumerate(manager.block_table(rid)):
            tokens_in_block[b] = max(tokens_in_block.get(b, 0), min(bs, max(0, n - dropped - i * bs)))
    num_used = pool.num_used_blocks
    runs = _free_runs(pool.ref_count(b) == 0 and not pool.is_parked(b) for b in range(pool.num_online_blocks))
    num_free = sum(runs)
    return {
        "num_blocks": pool.num_blocks,
        "num_used_blocks": num_used,
        "num_free_blocks": pool.num_free_blocks,
        "num_evictable_blocks": manager.num_evictable_blocks,
        "usage": manager.usage,
        "num_evicted_blocks": num_dropped,
        "internal_fragmentation": 1.0 - sum(tokens_in_block.values()) / (num_used * bs) if num_used else 0.0,
        "num_free_runs": len(runs),
        "largest_free_run": max(runs, default=0),
        "external_fragmentation": 1.0 - max(runs, default=0) / num_free if num_free else 0.0,
    }


def _free_runs(is_free: Iterable[bool]) -> list[int]:
    runs, current = [], 0
    for free in is_free:
        if free:
            current += 1
        elif current:
            runs.append(current)
            current = 0
    if current:
        runs.append(current)
    return runs
