"""Exports that cannot be written say why in one line: an unknown format, an existing output, a layer whose layout
no single tensor of the format holds; and ``mcp-compile --export`` end to end."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from mcp2026.cli import app
from mcp2026.errors import ExportError
from mcp2026.export.formats import export_model
from mcp2026.loading.loader import load_model
from mcp2026.quant import recipe
from mcp2026.quant.plan import LayerQuantSpec, QuantPlan

from conftest import save_tiny_hf
from export_models import compiled
from gguf_files import save_tiny_tokenizer

FORMATS = ("fp32", "int8", "int4")


@pytest.fixture(autouse=True)
def fixed_candidates(monkeypatch, one_thread):
    dtypes = {"int8": torch.bfloat16, "int4": torch.bfloat16}
    monkeypatch.setattr(recipe, "hardware_candidates", lambda device="cpu": (FORMATS, dtypes))


@pytest.mark.parametrize("fmt", ["gguf", "compressed-tensors"])
@pytest.mark.parametrize(
    ("spec", "tensors", "message"),
    [
        (
            LayerQuantSpec("int4", 32, high_rows=0.2),
            {},
            "lm_head: int4 g32 asym, 20% of rows int8 keeps some rows",
        ),
        (
            LayerQuantSpec("int4", 32, act_scale="awq"),
            {"awq": torch.rand(64) + 0.5},
            "lm_head: int4 g32 asym, AWQ",
        ),
        (LayerQuantSpec("int8", bias_correction="mean"), {"mean": torch.randn(64)}, "lm_head: has a bias"),
    ],
)
def test_a_layout_no_tensor_holds_is_an_error_naming_the_layer(tmp_path, fmt, spec, tensors, message):
    plan = QuantPlan({"lm_head": spec, "_default": LayerQuantSpec("int8")})
    loaded = compiled(tmp_path, plan, tensors=tensors)
    out = tmp_path / ("model.gguf" if fmt == "gguf" else "ct")
    with pytest.raises(ExportError, match=message):
        export_model(loaded, fmt, out)
    assert not out.exists() and not out.with_name(out.name + ".partial").exists()


def test_output_path_and_format_errors(tmp_path):
    loaded = compiled(tmp_path, QuantPlan.uniform("int8"))
    (tmp_path / "taken.gguf").write_text("x")
    with pytest.raises(ExportError, match="already exists"):
        export_model(loaded, "gguf", tmp_path / "taken.gguf")
    with pytest.raises(ExportError, match="ending in .gguf"):
        export_model(loaded, "gguf", tmp_path / "model.bin")
    with pytest.raises(ExportError, match="unknown export format 'onnx'; known: gguf, compressed-tensors"):
        export_model(loaded, "onnx", tmp_path / "x")
    loaded.tokenizer = None
    with pytest.raises(ExportError, match="has no tokenizer"):
        export_model(loaded, "gguf", tmp_path / "model.gguf")


def _compile(tmp_path, model_dir, *args: str):
    config = tmp_path / "quant.yaml"
    config.write_text("target_precision: int4\ngroup_size: 32\nsymmetric: true\n")
    return CliRunner().invoke(
        app, ["compile", str(model_dir), "--config", str(config), "--no-progress", *args]
    )


def test_compile_exports_gguf(tmp_path):
    source = save_tiny_tokenizer(save_tiny_hf(tmp_path / "src"))
    out = tmp_path / "model.gguf"
    result = _compile(tmp_path, source, "--export", "gguf", "--out", str(out))
    assert result.exit_code == 0, result.output + result.stderr
    assert "Q4_0" in result.stdout and "holds exactly the weights" in result.stdout
    formats = load_model(out).tensor_formats  # 14 linears in int4; uniform int4 keeps the lm_head int8
    assert formats["Q4_0"] == 14 and formats["Q8_0"] == 1
    again = _compile(tmp_path, source, "--export", "gguf", "--out", str(out))
    assert again.exit_code == 2 and "already exists" in again.stderr and "Traceback" not in again.stderr
    unknown = _compile(tmp_path, source, "--export", "onnx", "--out", str(tmp_path / "x"))
    assert unknown.exit_code == 2 and "unknown export format 'onnx'" in unknown.stderr
