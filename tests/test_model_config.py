"""ModelConfig's sliding-window, partial-rotary and rope-scaling fields: which layers slide, and clear errors
for inconsistent values."""

from __future__ import annotations

import pytest

from mcp2026.config import ModelConfig

SHAPE = dict(architecture="llama", vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=2,
             num_heads=4, num_kv_heads=2, head_dim=16)  # fmt: skip


def test_attention_window_per_layer():
    assert ModelConfig(**SHAPE).attention_window(0) is None
    every = ModelConfig(**SHAPE, sliding_window=8)
    assert [every.attention_window(i) for i in range(2)] == [8, 8]
    mixed = ModelConfig(**SHAPE, sliding_window=8, layer_types=["full_attention", "sliding_attention"])
    assert mixed.layer_types == ("full_attention", "sliding_attention")  # JSON lists become tuples
    assert [mixed.attention_window(i) for i in range(2)] == [None, 8]


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"sliding_window": 0}, "sliding_window must be > 0"),
        ({"sliding_window": 8, "layer_types": ("full_attention",)}, "names 1 layers, the model has 2"),
        ({"sliding_window": 8, "layer_types": ("full_attention", "chunked")}, "'chunked'"),
        ({"layer_types": ("full_attention", "sliding_attention")}, "sliding_window is not set"),
    ],
)
def test_inconsistent_window_fields_are_named(fields, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**SHAPE, **fields)


@pytest.mark.parametrize("rotary_dim", [0, 7, 18])
def test_rotary_dim_must_be_even_and_within_the_head(rotary_dim):
    with pytest.raises(
        ValueError, match=rf"rotary_dim must be an even number in \(0, head_dim=16\].*got {rotary_dim}"
    ):
        ModelConfig(**SHAPE, rotary_dim=rotary_dim)
    assert ModelConfig(**SHAPE, rotary_dim=12).rotary_dim == 12


@pytest.mark.parametrize(
    "scaling,message",
    [
        (
            {"rope_type": "longrope", "factor": 4.0},
            r"'longrope' is not supported \(supported: default, linear, ",
        ),
        ({"factor": 4.0}, "None is not supported"),
        ({"rope_type": "yarn", "factor": 4.0}, "'yarn' needs the field 'original_max_position_embeddings'"),
        ({"rope_type": "linear"}, "'linear' needs the field 'factor'"),
        ({"rope_type": "linear", "factor": 0}, "factor must be > 0"),
        ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"rope_type": "freq_factors", "freq_factors": [1.0] * 4}, "must be 8 positive numbers"),
    ],
)
def test_bad_rope_scaling_is_named(scaling, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**SHAPE, rope_scaling=scaling)


def test_supported_rope_scalings_are_accepted():
    for scaling in (
        {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 16},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32},
        {"rope_type": "freq_factors", "freq_factors": [1.0] * 8},
    ):
        assert ModelConfig(**SHAPE, rope_scaling=scaling).rope_scaling == scaling
