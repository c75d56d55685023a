"""Per-layer KV budget weights (``KVCompressor.layer_weights``): parsing, and calibrated sets by name.

A named set was calibrated offline for one model: the eviction simulation probes each layer's sensitivity (the
ΔPPL when only that layer evicts, on calibration texts), and a layer's weight is the square root of its share of
the probed loss, floored (docs/kv-cache.md, "Per-layer budgets"). The command that derives a set is next to it;
a set is checked against the model's layer count when the engine is built.
"""

from __future__ import annotations

from typing import Any

# SmolLM2-135M(-Instruct), 30 layers: `sensitivity:0+1` of `mcp2026 bench plugin
# examples/bench_plugins/kv_eviction_sim.py:EvictionSimulation --dtype fp32 --param defer_prompt=1 --param
# variants=block-split --param text=0+1+2+3 --param 'layer_budget=sensitivity:0+1'` (the kv bench's 2k texts 0
# and 1, heavy_hitter's rule at 70%; docs/kv-cache.md prints them as a weights: string; texts 2 and 3 are held
# out). L18 and L20, the layers that copy what a question asks for, get the most.
PRESETS: dict[str, tuple[float, ...]] = {
    "smollm2-135m": (
        0.130439,
        0.1,
        0.164006,
        0.171099,
        0.1,
        0.1,
        0.126029,
        0.401984,
        0.163495,
        0.139253,
        0.136531,
        0.1,
        0.1,
        0.1,
        0.194971,
        0.171942,
        0.1,
        0.293711,
        0.926868,
        0.131143,
        0.601053,
        0.163241,
        0.1,
        0.40713,
        0.18341,
        0.1,
        0.1,
        0.1,
        0.173951,
        0.1,
    ),
}


def parse_layer_weights(value: Any) -> tuple[float, ...]:
    """Weights from a preset name, a sequence of numbers, or a "w0/w1/..." (or comma-separated) string."""
    if isinstance(value, str) and value.strip() in PRESETS:
        return PRESETS[value.strip()]
    items = value.replace(",", "/").split("/") if isinstance(value, str) else value
    try:
        weights = tuple(float(w) for w in items)
    except (TypeError, ValueError):
        raise ValueError(
            f"KVCompressor.layer_weights must be a preset ({', '.join(sorted(PRESETS))}) or numbers, one per "
            f"layer (a list or 'w0/w1/...'), got {value!r}"
        ) from None
    if not weights or not all(0 < w < float("inf") for w in weights):
        raise ValueError(f"KVCompressor.layer_weights must be positive and finite, got {value!r}")
    return weights
