"""Bits per weight of every linear, for the bit-plan heatmap: from a live model, from a compiled artifact
folder, or from a plan.json applied to a model's shape (the model is built on the meta device: no weights
are read)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from mcp2026.config import ModelConfig
from mcp2026.loading.gguf import config_from_gguf, open_gguf
from mcp2026.loading.hf import config_from_hf, read_json
from mcp2026.loading.loader import default_model_path
from mcp2026.models.registry import build_model_skeleton
from mcp2026.quant.artifact import PLAN_FILE, is_artifact, read_metadata
from mcp2026.quant.plan import QuantPlan, layer_bits, linear_modules

model_layer_bits = layer_bits  # stored bits per weight of each linear of a live model (quant.plan)


def plan_layer_bits(plan: QuantPlan, config: ModelConfig, dense_bits: float = 32.0) -> dict[str, float]:
    """Bits per weight each linear of a ``config``-shaped model gets under ``plan``; layers the plan leaves
    alone keep ``dense_bits`` (the model's dtype)."""

    model = build_model_skeleton(config)
    bits = {}
    for name, module in linear_modules(model):
        spec = plan.spec_for(name)
        bits[name] = (
            dense_bits if spec is None else spec.bits_per_weight(module.in_features, module.out_features)
        )
    return bits


def _model_config(raw: Mapping) -> ModelConfig:
    raw = dict(raw)
    raw["eos_token_ids"] = tuple(raw.get("eos_token_ids") or ())
    return ModelConfig(**raw)


def _dtype_bits(name: str) -> float:
    return {"float32": 32.0, "bfloat16": 16.0, "float16": 16.0}.get(name.removeprefix("torch."), 32.0)


def read_layer_bits(path: str | Path, model: str | Path | None = None) -> dict[str, float]:
    """Per-layer bits from a compiled artifact folder, or from a plan.json applied to ``model``'s shape
    (default: the embedded model)."""

    path = Path(path)
    if path.is_dir():
        if not is_artifact(path):
            raise ValueError(f"{path}: not a compiled artifact folder (no metadata.json); give its plan.json")
        metadata = read_metadata(path)
        plan = QuantPlan.from_json((path / PLAN_FILE).read_text())
        return plan_layer_bits(plan, _model_config(metadata["model_config"]), _dtype_bits(metadata["dtype"]))
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such plan file or artifact folder")
    try:
        plan = QuantPlan.from_json(path.read_text())
    except (ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"{path}: not a QuantPlan JSON ({e})") from None
    return plan_layer_bits(plan, _config_of(model))


def _config_of(model: str | Path | None) -> ModelConfig:
    """The model's shape from its config.json or GGUF header, without loading weights."""

    path = Path(model) if model else default_model_path()
    if path.is_dir():
        return config_from_hf(read_json(path / "config.json"), str(path))

    return config_from_gguf(open_gguf(path), str(path))
