"""Model section: the weight distribution per linear layer (skewness, kurtosis, outliers, quant/stats.py)
and which layers need pre-compensation before low-bit quantization.

Loading the model and taking float64 moments of every weight takes tens of seconds on a small CPU, so
the per-layer figures are cached on disk per model file (path, size, modification time).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from mcp2026 import hardware
from mcp2026.doctor.context import DoctorContext
from mcp2026.doctor.model_files import ModelFiles
from mcp2026.doctor.result import CheckResult, passed, skipped, warned
from mcp2026.loading.loader import load_model
from mcp2026.quant.stats import KURTOSIS_LIMIT, SKEW_LIMIT, model_weight_stats

CACHE_FILE = "weight_stats.json"
WORST_SHOWN = 5


@dataclass(frozen=True)
class LayerStats:
    skewness: float
    kurtosis: float  # excess
    outlier_ratio: float
    needs_precompensation: bool


def _cache_key(files: ModelFiles) -> str:
    weights = [files.path] if files.path.is_file() else sorted(files.path.glob("*.safetensors"))
    mtime = max((f.stat().st_mtime_ns for f in weights), default=0)
    return f"{files.path.resolve()}|{files.file_bytes}|{mtime}"


def measure_layer_stats(path: Path) -> dict[str, LayerStats]:
    """Load the model in fp32 and take every linear layer's weight statistics."""

    stats = model_weight_stats(load_model(path).model)
    return {
        name: LayerStats(s.skewness, s.kurtosis, s.outlier_ratio, s.needs_precompensation)
        for name, s in stats.items()
    }


def layer_stats(files: ModelFiles, measure: bool = True) -> dict[str, LayerStats] | None:
    """Cached figures for this model file; measured (and cached) when absent and ``measure``, else None."""
    path = hardware.cache_dir() / CACHE_FILE
    key = _cache_key(files)
    try:
        cached = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        cached = {}
    if key in cached:
        try:
            return {name: LayerStats(**s) for name, s in cached[key].items()}
        except TypeError:
            pass  # another schema: measure again
    if not measure:
        return None
    stats = measure_layer_stats(files.path)
    cached[key] = {name: asdict(s) for name, s in stats.items()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cached))
        os.replace(tmp, path)
    except OSError:
        pass  # an unwritable cache only costs the next run the measurement
    return stats


def check_weight_distribution(ctx: DoctorContext) -> CheckResult:
    name = "weight distribution"
    if (skip := ctx.needs_model(name)) is not None:
        return skip
    files = ctx.model_files()
    if files.file_format == "mcp2026-artifact":
        return skipped(name, "a compiled artifact is already quantized (its plan chose per-layer formats)")
    stats = layer_stats(files, measure=not ctx.quick)
    if stats is None:
        return skipped(
            name, "not measured yet (--quick); a run without --quick loads the model once and caches it"
        )
    flagged = {n: s for n, s in stats.items() if s.needs_precompensation}
    worst = sorted(
        flagged.items(),
        key=lambda kv: -max(kv[1].kurtosis / KURTOSIS_LIMIT, abs(kv[1].skewness) / SKEW_LIMIT),
    )
    shown = ", ".join(f"{n} (skew {s.skewness:.2f}, kurt {s.kurtosis:.1f})" for n, s in worst[:WORST_SHOWN])
    reason = (
        f"{len(flagged)} of {len(stats)} linear layers need pre-compensation (|skew| > {SKEW_LIMIT} or "
        f"kurtosis > {KURTOSIS_LIMIT})" + (f"; worst: {shown}" if shown else "")
    )
    details = {
        "num_layers": len(stats),
        "num_flagged": len(flagged),
        "flagged": {n: asdict(s) for n, s in worst},
        "max_kurtosis": max((s.kurtosis for s in stats.values()), default=0.0),
        "max_abs_skewness": max((abs(s.skewness) for s in stats.values()), default=0.0),
        "max_outlier_ratio": max((s.outlier_ratio for s in stats.values()), default=0.0),
    }
    uniform = ctx.uniform_quant()
    if uniform is not None and flagged:
        return warned(
            name,
            f"{reason}, but the quant YAML quantizes every layer to {uniform.target_precision} without pre-compensation",
            "set enable_dqg: true in the quant YAML (the DQG pre-compensates flagged layers), or serve an "
            "artifact mcp-compile built from a DQG config",
            **details,
        )
    return passed(name, reason, **details)
