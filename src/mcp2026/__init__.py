"""mcp2026 (Model-Centric Pipeline): a PyTorch LLM inference engine that measures the model and the
traffic, then picks precision per layer, KV-cache policy and batch shape itself.

Public API (lazy: importing the package loads no torch until a name is used)::

    from mcp2026 import Pipeline, QuantConfig, KVCompressor
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = [
    "Pipeline",
    "QuantConfig",
    "KVConfig",
    "SchedulerConfig",
    "SamplingParams",
    "StructuredOutputs",
    "InferResult",
    "EmbeddingResult",
    "KVCompressor",
]

_LAZY = {
    "Pipeline": "mcp2026.pipeline",
    "QuantConfig": "mcp2026.config",
    "KVConfig": "mcp2026.config",
    "SchedulerConfig": "mcp2026.config",
    "SamplingParams": "mcp2026.types",
    "StructuredOutputs": "mcp2026.types",
    "InferResult": "mcp2026.types",
    "EmbeddingResult": "mcp2026.types",
    "KVCompressor": "mcp2026.kv.compressor",
}

if TYPE_CHECKING:
    from mcp2026.config import KVConfig, QuantConfig, SchedulerConfig
    from mcp2026.pipeline import Pipeline
    from mcp2026.types import EmbeddingResult, InferResult, SamplingParams, StructuredOutputs


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mcp2026' has no attribute {name!r}")
