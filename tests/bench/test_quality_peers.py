"""Peers in `bench quality`: HF transformers scores the same windows as our reference (on the same weights
its perplexity and log-probabilities must match ours), llama.cpp is skipped with a line when absent."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from mcp2026.bench.quality import evaluate, reference_logprobs
from mcp2026.bench.quality_peers import peer_quality_rows
from mcp2026.bench.quant_quality import QualityBench, QualityBenchSettings
from mcp2026.loading.loader import load_model

from gguf_files import write_tiny_gguf

pytestmark = pytest.mark.usefixtures("one_thread")


def test_hf_scores_the_same_windows_as_our_reference(tiny_llama_dir):
    model = load_model(tiny_llama_dir, dtype=torch.float32).model
    gen = torch.Generator().manual_seed(0)
    windows = [torch.randint(320, (64,), generator=gen) for _ in range(3)]
    reference = reference_logprobs(model, windows)
    rows, notes = peer_quality_rows(tiny_llama_dir, ("hf",), windows, reference)
    (hf,) = rows
    ours = evaluate(model, windows)
    assert hf["family"] == "peer" and hf["plan"].startswith("HF transformers")
    assert hf["num_tokens"] == ours.num_tokens == 3 * 31
    assert hf["ppl"] == pytest.approx(ours.ppl, rel=1e-4)  # same weights, same positions
    assert hf["kld"] < 1e-6 and hf["top1_agreement"] == 1.0 and notes == []


def test_a_peer_that_cannot_run_is_a_line_not_an_error(tiny_llama_dir, monkeypatch):
    import mcp2026.bench.peers as peers

    if importlib.util.find_spec("llama_cpp") is not None:  # present: make it absent for this test
        monkeypatch.setattr(peers.importlib.util, "find_spec", lambda name: None)
    windows = [torch.arange(64) % 320]
    rows, notes = peer_quality_rows(tiny_llama_dir, ("llama.cpp",), windows, [torch.zeros(31, 320)])
    assert rows == [] and len(notes) == 1 and notes[0].startswith("llama.cpp peer skipped")
    with pytest.raises(ValueError, match="unknown quality peers"):
        peer_quality_rows(tiny_llama_dir, ("vllm",), windows, [])


def test_peer_rows_are_in_the_run_but_not_among_the_plans():
    from mcp2026.bench.headline import headline_markdown
    from mcp2026.bench.quality_run import quality_run
    from mcp2026.bench.report import BenchRun

    def r(plan, family, bits, ppl, delta):
        return {"plan": plan, "family": family, "bits": bits, "mib": None, "ppl": ppl, "delta_ppl": delta,
                "delta_ppl_stderr": 0.001, "kld": 0.002, "kld_p99": 0.01, "top1_agreement": 0.99}  # fmt: skip

    rows = [
        {"plan": "fp32 (reference)", "family": "reference", "bits": 32.0, "mib": None, "ppl": 6.9, "num_tokens": 510},
        r("int8", "fixed", 8.02, 6.91, 0.0013),
        r("HF transformers fp32 (peer)", "peer", 32.0, 6.9, 0.0),
        r("llama.cpp, m.Q4_1.gguf as stored (peer)", "peer", None, 6.95, 0.007),
    ]  # fmt: skip
    settings = QualityBenchSettings(num_windows=2, peers=("hf", "llama.cpp"))
    bench = QualityBench(rows, "md", notes=["a note"])
    run = quality_run(bench, settings, "mcp2026 bench quality --num-windows 2")
    assert list(run.aggregates["plans"]) == ["int8"]
    assert set(run.aggregates["peers"]) == {rows[2]["plan"], rows[3]["plan"]}
    assert run.notes == ["a note"]
    md = headline_markdown([BenchRun.from_json(run.to_json())])
    line = next(x for x in md.splitlines() if x.startswith("| perplexity of the model, ours fp32"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[1:4] == ["6.9", "6.9 (fp32)", "6.95 (m.Q4_1.gguf as stored)"]
    assert cells[5].startswith("1.00x HF, 0.99x llama.cpp")


@pytest.mark.parametrize(("weight_type", "bits"), [("Q8_0", 8.5), ("Q4_0", 4.5), ("Q4_1", 5.0)])
def test_weight_bits_count_block_scales_over_the_files_matrices(tmp_path, weight_type, bits):
    from mcp2026.bench.llama_cpp_quantize import weight_bits

    assert weight_bits(write_tiny_gguf(tmp_path / "m.gguf", weight_type)) == pytest.approx(bits)


def test_llama_cpp_formats_are_skipped_with_a_line_without_llama_cpp(tmp_path, monkeypatch):
    import mcp2026.bench.llama_cpp_quantize as quantize

    monkeypatch.setattr(quantize.importlib.util, "find_spec", lambda name: None)
    source = write_tiny_gguf(tmp_path / "m.gguf", "Q8_0")
    rows, notes = peer_quality_rows(source, ("llama.cpp:Q4_K_M",), [torch.zeros(8, dtype=torch.long)], [])
    assert rows == [] and notes == ["llama.cpp Q4_K_M peer skipped: llama-cpp-python is not installed"]


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed")
def test_llama_cpp_requantizes_the_file_and_scores_it(tmp_path):
    source = write_tiny_gguf(tmp_path / "m.gguf", "Q4_1")
    model = load_model(source, dtype=torch.float32).model
    gen = torch.Generator().manual_seed(0)
    windows = [torch.randint(320, (64,), generator=gen) for _ in range(2)]
    rows, notes = peer_quality_rows(source, ("llama.cpp:Q8_0",), windows, reference_logprobs(model, windows))
    (row,) = rows
    assert notes == [] and row["family"] == "llama.cpp" and row["plan"].startswith("llama.cpp Q8_0")
    # Q8_0 of Q4_1 weights: close to the reference, not equal (and llama.cpp quantizes activations too)
    assert row["bits"] == pytest.approx(8.5) and 0 < row["kld"] < 0.05
