"""A file's rope scaling as the loaders hand it to ModelConfig: transformers' defaults and the context length."""

from __future__ import annotations

import pytest

from mcp2026.errors import ModelLoadError
from mcp2026.loading.rope_scaling import normalized_rope_scaling


def test_plain_rope_is_none():
    assert normalized_rope_scaling(None, 512, "m") == (None, 512)
    assert normalized_rope_scaling({"rope_type": "default", "rope_theta": 1e4}, 512, "m") == (None, 512)


def test_old_type_key_and_transformers_defaults():
    scaling, context = normalized_rope_scaling({"type": "llama3", "factor": 8.0}, 131072, "m")
    assert scaling == {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 131072}
    assert context == 131072  # llama3 and linear configs state their extended length themselves


def test_dynamic_counts_from_max_position_embeddings_and_extends_the_context():
    # transformers ignores an original length inside a dynamic rope_scaling: its base grows past max_position
    scaling, context = normalized_rope_scaling(
        {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 100}, 4096, "m"
    )
    assert scaling["original_max_position_embeddings"] == 4096 and context == 8192


@pytest.mark.parametrize(
    "max_positions,context",
    [(32768, 131072), (163840, 163840)],
    ids=["original-length-config", "extended-length-config"],
)
def test_yarn_runs_factor_times_the_original_context(max_positions, context):
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert normalized_rope_scaling(scaling, max_positions, "m")[1] == context


def test_unknown_type_names_the_source():
    with pytest.raises(
        ModelLoadError, match=r"^m/config.json: rope scaling type 'longrope' is not supported"
    ):
        normalized_rope_scaling({"rope_type": "longrope"}, 4096, "m/config.json")
