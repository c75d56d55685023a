"""Sliding-window layers over the paged cache: sequences stay within the smallest window, with a warning."""

from __future__ import annotations

import logging

from mcp2026.engine.engine import LLMEngine

from conftest import tiny_random_model


def test_engine_caps_sequences_at_the_smallest_window(caplog):
    model, config = tiny_random_model(sliding_window=24, layer_types=("sliding_attention", "full_attention"))
    with caplog.at_level(logging.WARNING):
        engine = LLMEngine(model, config, None)
    assert engine.max_model_len == 24
    assert "sliding-window layers (24 positions)" in caplog.text


def test_engine_without_windows_keeps_the_model_length():
    model, config = tiny_random_model()
    assert LLMEngine(model, config, None).max_model_len == config.max_position_embeddings
