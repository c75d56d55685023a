"""The GPU check's stages, run on the CPU with a 2-layer model (their figures mean nothing here; what is
checked is that every stage runs and reports, and that the docs section is written between its markers)."""

from __future__ import annotations

import pytest

from mcp2026.bench import gpu_check


@pytest.fixture(scope="module")
def results():
    return gpu_check.run(quick=True, tiny=True)


def test_every_quick_stage_reports_figures(results):
    for stage in ("exactness", "decode_batch1_bf16", "batch64_128in_128out_bf16", "prefill_8x2048_bf16"):
        assert "error" not in results[stage], results[stage]
    ex = results["exactness"]
    assert ex["prefill_fp32_max_abs_diff"] < 1e-3  # our CPU path against HF's, both fp32
    assert ex["decode_fp32_max_gap_to_hf_argmax"] < 1e-3
    assert results["decode_batch1_bf16"]["ours_graphs_ms_per_token"] > 0
    assert results["batch64_128in_128out_bf16"]["hf_static_output_tok_s"] > 0


def test_docs_section_is_replaced_between_markers(results, tmp_path):
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n\nintro\n")
    gpu_check.write_docs(docs, gpu_check.markdown(results))
    first = docs.read_text()
    assert first.count(gpu_check.START) == 1 and "| prefill 8 x 2048 bf16, tok/s |" in first
    gpu_check.write_docs(docs, gpu_check.markdown(results))
    assert docs.read_text() == first  # rewritten in place, not appended twice


def test_the_quantized_kv_stage_reports_both_codecs(results, tmp_path):
    import torch

    path = gpu_check.build_checkpoint(tmp_path / "tiny")  # the fixture's run left the check at its tiny size
    out = gpu_check.kv_quantized_decode(gpu_check.ours(path, torch.float32))
    for dtype in ("int8", "fp8"):
        assert "error" not in out[dtype], out[dtype]
        assert out[dtype]["ms_per_token"] > 0 and out[dtype]["batch64_output_tok_s"] > 0
        assert out[dtype]["graphs"] is False  # graphs are captured on CUDA only
    assert "| int8 KV cache (bf16 weights)" in gpu_check.markdown(
        {**results, "kv_quantized_decode_bf16": out}
    )
