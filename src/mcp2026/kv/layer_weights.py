"""Per-layer KV budget weights (``KVCompressor.layer_weights``): parsing, calibrated sets by name, and the
``"auto"`` rule that picks a calibrated set for the model being served.

A named set was calibrated for one model: ``mcp2026 kv calibrate`` (kv.calibrate) probes each layer's sensitivity
(the ΔPPL when only that layer evicts, on calibration texts), and a layer's weight is the square root of its share
of the probed loss, floored (docs/kv-cache.md, "Per-layer budgets"). The command that derives a set is next to it;
a set is checked against the model's layer count when the engine is built.

``"auto"`` (the default) takes a set only for the model shape it was calibrated on (layers, widths, heads,
vocabulary, RoPE base and context) and only for the policies it was measured with; any other model or policy
keeps the same budget in every layer. A set tuned on one model says nothing about another's layers.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mcp2026.config import ModelConfig
from mcp2026.hardware import cache_dir

log = logging.getLogger(__name__)

AUTO, UNIFORM = "auto", "uniform"
# what identifies a model's layers for a calibrated set: its shape, RoPE base and context (SmolLM v1 and v2
# 135M share every width and differ in rope_theta and context). Not the architecture name: a GGUF file says
# "llama" where the same model's HF folder says "LlamaForCausalLM".
FINGERPRINT = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "rope_theta",
    "max_position_embeddings",
)

# SmolLM2-135M(-Instruct), 30 layers. "smollm2-135m" (the default under "auto"): `mcp2026 kv calibrate
# --texts 2` (heavy_hitter at 70%, two 2k held-out ShareGPT texts at seed 1, disjoint from all four of the kv
# bench's seed-0 texts; docs/data/kv-calibration-smollm2-135m.json has every probe). On the bench's four 2k texts,
# all held out: ΔPPL +2.50% pooled (uniform +13.7%). L18 and L20, the layers that copy what a question asks for,
# get the most. "smollm2-135m-sim": the same rule in the eviction simulation, `sensitivity:0+1` of
# `mcp2026 bench plugin examples/bench_plugins/kv_eviction_sim.py:EvictionSimulation --dtype fp32 --param
# defer_prompt=1 --param variants=block-split --param text=0+1+2+3 --param 'layer_budget=sensitivity:0+1'`,
# calibrated on the bench's texts 0 and 1 (+2.82% pooled); kept to rerun comparisons against it.
PRESETS: dict[str, tuple[float, ...]] = {
    "smollm2-135m": (
        0.145733,
        0.1,
        0.176045,
        0.1,
        0.1,
        0.1,
        0.1,
        0.376817,
        0.169621,
        0.118824,
        0.1,
        0.1,
        0.1,
        0.1,
        0.299681,
        0.106786,
        0.1,
        0.439075,
        0.943179,
        0.13807,
        0.440579,
        0.207109,
        0.1,
        0.437367,
        0.262952,
        0.1,
        0.1,
        0.1,
        0.1,
        0.1,
    ),
    "smollm2-135m-sim": (
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


@dataclass(frozen=True)
class Calibration:
    """Where a preset applies under ``"auto"``: the model it was calibrated on and the policies measured."""

    fingerprint: dict[str, Any]
    policies: tuple[str, ...]


# SmolLM2-135M-Instruct (the embedded default model) and its base model share this shape. Calibrated with
# heavy_hitter's rule; at 70% over the kv bench's four 2k texts it helps every policy (docs/benchmarks.md,
# kv-calibrate and kv-layer-budgets-policies), so "auto" gives it to all four.
CALIBRATIONS: dict[str, Calibration] = {
    "smollm2-135m": Calibration(
        fingerprint={
            "vocab_size": 49152,
            "hidden_size": 576,
            "intermediate_size": 1536,
            "num_layers": 30,
            "num_heads": 9,
            "num_kv_heads": 3,
            "head_dim": 64,
            "rope_theta": 100000.0,
            "max_position_embeddings": 8192,
        },
        policies=("heavy_hitter", "snap", "sink_window", "dynamic_window"),
    ),
}


def fingerprint(config: ModelConfig) -> dict[str, Any]:
    return {name: getattr(config, name) for name in FINGERPRINT}


def auto_weights(config: ModelConfig, policy: str) -> tuple[str, tuple[float, ...]] | None:
    """What ``"auto"`` takes for this model and policy, as (where from, weights), or None (uniform budgets):
    an installed calibration (``mcp2026 kv calibrate --install``) first, then a built-in preset."""
    shape = fingerprint(config)
    for path, data in installed_calibrations():
        if data["fingerprint"] == shape and data["policy"] == policy:
            return str(path), tuple(data["weights"])
    for name, calibration in CALIBRATIONS.items():
        if calibration.fingerprint == shape and policy in calibration.policies:
            return name, PRESETS[name]
    return None


# --- calibration files (``mcp2026 kv calibrate``) ---------------------------------------------------------
FILE_KIND = "mcp2026.kv-layer-weights"


def calibrations_dir() -> Path:
    """Where ``mcp2026 kv calibrate --install`` puts files for ``"auto"`` (under ``MCP2026_CACHE_DIR``)."""

    return cache_dir() / "kv-layer-weights"


def read_weights_file(path: str | Path) -> dict[str, Any]:
    """A calibration file: its weights, the model fingerprint and policy it was measured for, its probes."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"KVCompressor.layer_weights: no such file {str(path)!r}") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"KVCompressor.layer_weights: {path} is not a readable JSON file ({e})") from None
    ok = (
        isinstance(data, dict)
        and data.get("kind") == FILE_KIND
        and isinstance(data.get("fingerprint"), dict)
        and isinstance(data.get("policy"), str)
        and isinstance(data.get("weights"), list)
    )
    if not ok:
        raise ValueError(
            f"KVCompressor.layer_weights: {path} is not a layer-weights file (kind {FILE_KIND!r} with "
            "fingerprint, policy and weights; `mcp2026 kv calibrate` writes them)"
        )
    data["weights"] = list(_checked(data["weights"], str(path)))
    return data


def installed_calibrations() -> list[tuple[Path, dict[str, Any]]]:
    """Every readable calibration file in ``calibrations_dir()``; a broken one is skipped with a warning."""
    folder = calibrations_dir()
    found = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            found.append((path, read_weights_file(path)))
        except ValueError as e:
            log.warning("skipping %s: %s", path, e)
    return found


def preset_name(weights: Any) -> str | None:
    """The preset these weights are, if any (for reports and logs)."""
    found = [name for name, preset in PRESETS.items() if tuple(weights or ()) == preset]
    return found[0] if found else None


def parse_layer_weights(value: Any) -> tuple[float, ...]:
    """Weights from a preset name, a calibration file (``.json``, from ``mcp2026 kv calibrate``), a sequence of
    numbers, or a "w0/w1/..." (or comma-separated) string. ``"auto"`` and ``"uniform"`` are the compressor's to
    resolve, not weights."""
    if isinstance(value, str) and value.strip() in PRESETS:
        return PRESETS[value.strip()]
    if isinstance(value, (str, Path)) and str(value).strip().endswith(".json"):
        return tuple(read_weights_file(str(value).strip())["weights"])
    items = value.replace(",", "/").split("/") if isinstance(value, str) else value
    return _checked(items, value)


def _checked(items: Any, value: Any) -> tuple[float, ...]:
    try:
        weights = tuple(float(w) for w in items)
    except (TypeError, ValueError):
        raise ValueError(
            f"KVCompressor.layer_weights must be 'auto', 'uniform', a preset ({', '.join(sorted(PRESETS))}), a "
            f"calibration file (.json) or numbers, one per layer (a list or 'w0/w1/...'), got {value!r}"
        ) from None
    if not weights or not all(0 < w < float("inf") for w in weights):
        raise ValueError(f"KVCompressor.layer_weights must be positive and finite, got {value!r}")
    return weights
