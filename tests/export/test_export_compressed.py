"""compressed-tensors export: int8 rows and symmetric int4 exactly as we run them, asymmetric int4 with each
group's zero rounded to an integer zero point; our loader and transformers read the folder back."""

from __future__ import annotations

import json

import pytest
import torch

from mcp2026.export.compressed_tensors import export_compressed_tensors
from mcp2026.export.report import CONVERTED
from mcp2026.loading.loader import load_model
from mcp2026.pipeline import native_weights_blocker
from mcp2026.quant.int4_linear import Int4Linear
from mcp2026.quant.plan import LayerQuantSpec, QuantPlan

from export_models import compiled, dequantized_copy, logits, with_weights

SYMMETRIC = QuantPlan({
    "layers.0.attn.qkv_proj": LayerQuantSpec("int8"),
    "layers.1.mlp.gate_up_proj": LayerQuantSpec("int4", 64, symmetric=True),
    "lm_head": LayerQuantSpec("fp32"),
    "_default": LayerQuantSpec("int4", 32, symmetric=True),
})  # fmt: skip


@pytest.fixture(autouse=True)
def _threads(one_thread):
    pass


def test_symmetric_plan_round_trips_exactly(tmp_path):
    loaded = compiled(tmp_path, SYMMETRIC)
    ours = dequantized_copy(loaded.model)
    report = export_compressed_tensors(loaded, tmp_path / "ct")
    assert report.max_relative_error == 0.0
    quant = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    assert quant["quant_method"] == "compressed-tensors" and quant["format"] == "pack-quantized"
    schemes = {
        json.dumps(g["weights"], sort_keys=True): g["targets"] for g in quant["config_groups"].values()
    }
    assert len(schemes) == 3 and "lm_head" in quant["ignore"]
    back = load_model(tmp_path / "ct")
    again = dequantized_copy(back.model)
    for name, w in ours.items():
        assert torch.equal(again[name], w), name
    ids = torch.randint(320, (24,))
    expected = logits(with_weights(loaded.model, ours), ids)
    torch.testing.assert_close(logits(back.model, ids), expected, rtol=0, atol=1e-5)
    assert back.tokenizer.encode("Hello abc 2026") == loaded.tokenizer.encode("Hello abc 2026")


def test_asymmetric_int4_gets_integer_zero_points(tmp_path, kernels):
    loaded = compiled(tmp_path, QuantPlan.uniform("int4", group_size=32))
    module = loaded.model.layers[0].mlp.down_proj
    assert isinstance(module, Int4Linear)
    step = (
        module.scales_and_zeros[..., 0].float().abs().t().repeat_interleave(32, dim=1)
    )  # (N, K) group scales
    ours = dequantized_copy(loaded.model)
    report = export_compressed_tensors(loaded, tmp_path / "ct")
    assert any(r.origin == CONVERTED for r in report.tensors) and report.notes
    back = load_model(tmp_path / "ct")
    moved = (dequantized_copy(back.model)["layers.0.mlp.down_proj"] - ours["layers.0.mlp.down_proj"]).abs()
    assert (moved <= step / 2 + 1e-6).all() and moved.max() > 0  # at most half a step, one shift per group
    native = load_model(
        tmp_path / "ct", native=True
    )  # int4 blocks on our GEMM: the weights read back exactly
    assert native.weights == "native"
    assert torch.equal(
        native.model.layers[0].mlp.down_proj.dequantize(),
        dequantized_copy(back.model)["layers.0.mlp.down_proj"],
    )


def test_transformers_loads_the_export(tmp_path):
    pytest.importorskip(
        "compressed_tensors", reason="the compressed-tensors package (dev extra) is not installed"
    )
    from transformers import AutoModelForCausalLM  # defer: heavy, and only this test needs it

    loaded = compiled(tmp_path, SYMMETRIC)
    export_compressed_tensors(loaded, tmp_path / "ct")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ct").eval()
    ids = torch.randint(320, (24,))
    with torch.no_grad():
        theirs = hf(ids[None]).logits[0]
    ours = logits(load_model(tmp_path / "ct").model, ids)
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-4)  # the same fp32 weights, two implementations


def test_pipeline_runs_a_compressed_folder_as_stored(tmp_path, kernels):
    loaded = compiled(tmp_path, SYMMETRIC)
    export_compressed_tensors(loaded, tmp_path / "ct")
    assert native_weights_blocker(tmp_path / "ct", "auto", None, "cpu") is None
    assert native_weights_blocker(tmp_path / "src", "auto", None, "cpu") is not None  # a plain HF folder
