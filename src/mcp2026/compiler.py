"""The body of ``mcp2026 compile`` / ``mcp-compile``: read a quantization YAML, calibrate, plan, quantize
and write an artifact folder that ``Pipeline(model=DIR)`` loads without recalibrating, or export the quantized
model to another engine's format (GGUF, compressed-tensors)."""

from __future__ import annotations

from pathlib import Path

from mcp2026.export.formats import check_export, export_model
from mcp2026.export.report import ExportReport
from mcp2026.loading.loader import load_model
from mcp2026.quant import recipe
from mcp2026.quant.artifact import is_artifact, save_artifact
from mcp2026.quant.compile_cli import load_spec


def compile_model(
    model: str | Path | None,
    config_path: str | Path,
    out_dir: str | Path,
    *,
    progress: bool = True,
    console=None,
    export: str | None = None,
) -> Path | ExportReport:
    """Load, calibrate, plan, quantize, save (the artifact folder, or with ``export`` that format's file or folder,
    returning its report). Prints the plan table to ``console`` (a rich Console)."""
    spec = load_spec(config_path)
    if not spec.quant.quantizes_weights:
        raise ValueError(
            f"{config_path}: target_precision={spec.quant.target_precision!r} without enable_dqg quantizes "
            "nothing; set int8 / int4 / fp8, or enable_dqg: true"
        )
    out = Path(out_dir)
    if export is not None:
        check_export(export, out)
    elif out.exists() and (not out.is_dir() or (any(out.iterdir()) and not is_artifact(out))):
        raise ValueError(f"{out}: exists and is not an empty folder or an artifact; choose another --out")
    loaded = load_model(model)
    if loaded.file_format == "mcp2026-artifact":
        raise ValueError(f"{loaded.source}: already a compiled artifact; compile the source model instead")
    result = recipe.quantize_model(
        loaded.model, loaded.tokenizer, spec.quant, "cpu",
        settings=spec.dqg, calibration=spec.calibration, gptq_settings=spec.gptq,
        learned_settings=spec.learned, progress=progress,
    )  # fmt: skip
    if console is not None:
        if result.layers:
            console.print(result.to_table(), width=max(console.width, 180))  # 13 columns, even piped
        console.print(recipe.describe(result, loaded.model))
    if export is not None:
        return export_model(loaded, export, out)
    return save_artifact(out, loaded, result, spec.quant)
