"""Windowed perplexity of a bare model: llama.cpp-style windows."""

from __future__ import annotations

from mcp2026.quant.perplexity import scored_positions, scored_targets, windows_from_tokens


def test_windows_and_bos():
    windows = windows_from_tokens(list(range(1, 1100)), n_ctx=512, bos_token_id=0)
    assert len(windows) == 2 and all(len(w) == 512 for w in windows)
    assert windows[0][0] == 0 and windows[1][0] == 0 and windows[1][1] == 514
    assert len(windows_from_tokens(range(2000), 512, num_windows=1)) == 1


def test_scored_positions_are_the_second_half_and_predict_the_next_token():
    window = windows_from_tokens(list(range(100)), n_ctx=10)[0]
    assert scored_positions(10) == slice(5, 9)
    assert scored_targets(window).tolist() == list(range(6, 10))
