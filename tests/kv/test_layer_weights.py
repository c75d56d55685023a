"""Per-layer budget weights: parsing, presets, and what ``layer_weights="auto"`` picks for which model."""

from __future__ import annotations

import dataclasses

import pytest

from mcp2026.config import ModelConfig
from mcp2026.kv.compressor import KVCompressor
from mcp2026.kv.layer_weights import (
    CALIBRATIONS,
    PRESETS,
    auto_weights,
    fingerprint,
    parse_layer_weights,
    preset_name,
)

SMOLLM2 = ModelConfig(
    architecture="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rope_theta=100000.0,
    max_position_embeddings=8192,
)


def test_every_calibration_names_a_preset_of_its_layer_count():
    for name, calibration in CALIBRATIONS.items():
        assert len(PRESETS[name]) == calibration.fingerprint["num_layers"]


def test_auto_takes_the_preset_only_for_its_model_and_policy():
    assert auto_weights(SMOLLM2, "heavy_hitter")[0] == "smollm2-135m"
    # the same model as an HF folder names its architecture differently
    assert auto_weights(dataclasses.replace(SMOLLM2, architecture="LlamaForCausalLM"), "heavy_hitter")
    for policy in ("snap", "sink_window", "dynamic_window"):  # each measured with them (docs/benchmarks.md)
        assert auto_weights(SMOLLM2, policy)[0] == "smollm2-135m"
    # SmolLM (v1) 135M: the same widths, another RoPE base and context
    v1 = dataclasses.replace(SMOLLM2, rope_theta=10000.0, max_position_embeddings=2048)
    assert auto_weights(v1, "heavy_hitter") is None
    assert auto_weights(dataclasses.replace(SMOLLM2, num_layers=32), "heavy_hitter") is None


def test_compressor_resolves_auto_for_a_model():
    kv = KVCompressor(dtype="fp32", policy="heavy_hitter")
    assert kv.layer_weights == "auto"  # the default
    assert kv.for_model(SMOLLM2).layer_weights == PRESETS["smollm2-135m"]
    other = dataclasses.replace(SMOLLM2, hidden_size=640, num_heads=10, num_kv_heads=5)
    assert kv.for_model(other).layer_weights is None
    # explicit settings are never overridden
    assert (
        KVCompressor(policy="heavy_hitter", layer_weights="uniform").for_model(SMOLLM2).layer_weights is None
    )
    assert KVCompressor(policy="heavy_hitter", layer_weights=None).layer_weights is None
    explicit = KVCompressor(policy="heavy_hitter", layer_weights="1/2").for_model(SMOLLM2)
    assert explicit.layer_weights == (1.0, 2.0)
    # no eviction, nothing to share: auto is harmless, explicit weights are an error
    assert KVCompressor(policy="none").for_model(SMOLLM2).layer_weights is None
    with pytest.raises(ValueError, match="policy='none' has none"):
        KVCompressor(policy="none", layer_weights="smollm2-135m")
    # configs round-trip
    assert KVCompressor.from_dict(kv.to_dict()) == kv
    assert KVCompressor.from_yaml("policy: heavy_hitter\nlayer_weights: uniform\n").layer_weights is None


def test_parse_and_name():
    assert parse_layer_weights("smollm2-135m") == PRESETS["smollm2-135m"]
    assert parse_layer_weights("1, 2/3") == (1.0, 2.0, 3.0)
    assert preset_name(PRESETS["smollm2-135m"]) == "smollm2-135m"
    assert preset_name((1.0, 2.0)) is None
    assert fingerprint(SMOLLM2)["rope_theta"] == 100000.0


def test_the_default_model_is_the_calibrated_one(default_model_path):
    """The embedded default model's GGUF config carries the fingerprint its preset was calibrated for."""
    from mcp2026.loading.gguf import config_from_gguf, open_gguf

    config = config_from_gguf(open_gguf(default_model_path), str(default_model_path))
    assert auto_weights(config, "heavy_hitter")[0] == "smollm2-135m"
