"""Run records: JSON round trip, markdown rendering, and splicing sections into docs/benchmarks.md."""

from __future__ import annotations

import pytest

from mcp2026.bench.report import (
    BenchRun,
    Table,
    project_root,
    read_benchmarks_section,
    read_run,
    render_markdown,
    update_benchmarks_md,
    write_run,
)


def make_run() -> BenchRun:
    return BenchRun(
        kind="offline",
        command="mcp2026 bench offline --num-prompts 4",
        config={"num_prompts": 4, "dtype": "fp32"},
        records=[{"engine": "mcp2026", "request_id": "r0", "prompt_len": 5, "ttft_s": 0.01}],
        aggregates={"mcp2026": {"output_tok_per_s": 123.456}, "ratio": {"output_tok_per_s": 5.1}},
        tables=[
            Table(
                "Offline",
                ["engine", "output tok/s", "ratio"],
                [["mcp2026", 123.456, "5.10x"], ["hf", 24.2, None]],
            )
        ],
        notes=["HF peer skipped"],
        machine={"cpu_model": "Test CPU", "usable_cores": 2, "cpu_flags": {"avx2": True, "avx512f": False}},
    )


def test_json_round_trip(tmp_path):
    run = make_run()
    path = write_run(run, tmp_path)
    assert path.suffix == ".json" and path.with_suffix(".md").exists()
    assert read_run(path) == run
    assert BenchRun.from_json(run.to_json()) == run
    assert write_run(run, tmp_path) != path  # same second: a new name, nothing overwritten


def test_markdown_has_table_command_and_machine():
    md = render_markdown(make_run())
    assert "| engine | output tok/s | ratio |" in md
    assert "| mcp2026 | 123.5 | 5.10x |" in md
    assert "| hf | 24.2 | — |" in md
    assert "Command: `mcp2026 bench offline --num-prompts 4`" in md
    assert "Test CPU, 2 cores" in md and "avx2" in md and "avx512f" not in md
    assert "- HF peer skipped" in md
    run = make_run()
    run.machine["cpu_family_model"] = "family 26, model 2"  # what tells an "AMD EPYC"'s generation
    assert "Test CPU (family 26, model 2), 2 cores" in render_markdown(run)


def test_update_benchmarks_md_replaces_only_its_section(tmp_path):
    path = tmp_path / "docs" / "benchmarks.md"
    update_benchmarks_md("latency", "first latency", path)
    assert path.read_text().startswith("# Benchmarks\n")
    text = path.read_text() + "\nHand-written notes stay.\n"
    path.write_text(text)
    update_benchmarks_md("offline-sharegpt", "offline table", path)
    update_benchmarks_md("latency", "second latency\nwith two lines", path)
    text = path.read_text()
    assert "first latency" not in text
    assert "<!-- bench:latency -->\nsecond latency\nwith two lines\n<!-- /bench:latency -->" in text
    assert "<!-- bench:offline-sharegpt -->\noffline table\n<!-- /bench:offline-sharegpt -->" in text
    assert "Hand-written notes stay." in text
    assert text.count("<!-- bench:latency -->") == 1
    before = path.read_text()
    update_benchmarks_md("latency", "second latency\nwith two lines", path)
    assert path.read_text() == before  # idempotent
    with pytest.raises(ValueError, match="section"):
        update_benchmarks_md("bad name!", "x", path)


# The sections `make bench` and `make bench-quality` rewrite with --write-docs (latency, both offline runs, kv,
# quality, then the headline): a missing marker would make the writer append a second table instead.
WRITTEN_SECTIONS = ("latency", "offline-batched-decode-32", "offline-sharegpt", "kv", "quality", "headline")


@pytest.mark.parametrize("section", WRITTEN_SECTIONS)
def test_the_docs_keep_every_section_the_writers_replace(section):
    text = (project_root() / "docs" / "benchmarks.md").read_text()
    assert text.count(f"<!-- bench:{section} -->") == 1 and text.count(f"<!-- /bench:{section} -->") == 1
    assert read_benchmarks_section(section).strip()
