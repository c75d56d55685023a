"""Weight quantization: what the device runs fast (backend), the quantization math (quantizer), quantized
linears (linear), per-layer plans (plan) and the statistics the DQG decides from (stats). Names load lazily
on first use."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "backend": ("BackendReport", "BenchSettings", "FormatReport", "candidates", "clamp_bits", "default_activation_dtype", "probe"),
    "linear": (
        "LINEAR_FORMATS", "QuantLinear", "DenseLinear", "Int8Linear", "Int4Linear", "Fp8Linear", "quantize_",
        "pack_int4", "unpack_int4",
    ),
    "quantizer": (
        "quantize_per_channel_int8", "dequantize_per_channel_int8", "quantize_groupwise_int4", "search_groupwise_int4",
        "dequantize_groupwise_int4", "fake_quantize", "mse_clip_ratios", "search_act_scale",
    ),
    "plan": ("FORMATS", "LayerQuantSpec", "QuantPlan"),
    "stats": ("ActivationStats", "ActivationStatsCollector", "WeightStats", "model_weight_stats", "weight_stats"),
}  # fmt: skip
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    if name in _MODULE_OF:
        return getattr(importlib.import_module(f"mcp2026.quant.{_MODULE_OF[name]}"), name)
    raise AttributeError(f"module 'mcp2026.quant' has no attribute {name!r}")
