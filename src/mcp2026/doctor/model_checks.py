"""Model section: files present and intact, architecture supported, the quantization YAML readable."""

from __future__ import annotations

from mcp2026.doctor.context import DoctorContext
from mcp2026.doctor.result import CheckResult, failed, passed, skipped
from mcp2026.errors import MCPError, UnsupportedArchitectureError


def check_model_files(ctx: DoctorContext) -> CheckResult:
    name = "files"
    try:
        files = ctx.model_files()
    except MCPError as e:
        return failed(
            name,
            str(e),
            "point --model (or the serve config's model) at an intact HF folder or .gguf; download it again "
            "if it is truncated",
        )
    return passed(
        name,
        f"{files.path}: {files.summary}; every tensor lies inside its file",
        path=str(files.path),
        format=files.file_format,
        bytes=files.file_bytes,
        num_tensors=files.num_tensors,
        tensor_types=files.tensor_types,
    )


def check_architecture(ctx: DoctorContext) -> CheckResult:
    name = "architecture"
    try:
        ctx.model_files()
    except MCPError:
        return skipped(name, "needs readable model files (see model/files)")
    try:
        cfg = ctx.model_config()
    except UnsupportedArchitectureError as e:
        return failed(name, str(e), "use a model of a supported architecture (docs/models.md lists them)")
    except MCPError as e:
        return failed(
            name, str(e), "the model's config is inconsistent: re-export or download the model again"
        )
    return passed(
        name,
        f"{cfg.architecture}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, heads {cfg.num_heads}/"
        f"{cfg.num_kv_heads} x {cfg.head_dim}, context {cfg.max_position_embeddings}, "
        f"{cfg.num_params / 1e6:.1f} M parameters",
        architecture=cfg.architecture,
        num_params=cfg.num_params,
        num_layers=cfg.num_layers,
        context=cfg.max_position_embeddings,
    )


def check_quant_config(ctx: DoctorContext) -> CheckResult:
    name = "quant config"
    if not ctx.serve.quant:
        return skipped(name, "no quant YAML configured: weights run as stored")
    try:
        quant = ctx.quant_config
    except (ValueError, OSError, MCPError) as e:
        return failed(name, str(e), "fix the quantization YAML (examples: examples/quant/*.yaml)")
    return passed(
        name,
        f"{ctx.serve.quant}: target {quant.target_precision}"
        + (f", DQG budget {quant.bits_budget} bits/weight" if quant.enable_dqg and quant.bits_budget else ""),
        target_precision=quant.target_precision,
        enable_dqg=quant.enable_dqg,
    )
