"""``mcp2026 compile`` (alias ``mcp-compile``): calibrate, plan and quantize a model into an artifact folder, or
export it as GGUF (llama.cpp) or compressed-tensors (transformers, vLLM)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from mcp2026.cli_errors import user_errors
from mcp2026.compiler import compile_model

out = Console(emoji=False)


@user_errors
def compile_cmd(
    model: Annotated[
        Path | None, typer.Argument(help="HF folder or .gguf to quantize (default: embedded SmolLM2-135M)")
    ] = None,
    config: Annotated[
        Path | None, typer.Option("--config", help="quantization YAML (see examples/quant/)")
    ] = None,
    out_dir: Annotated[
        Path | None,
        typer.Option(
            "--out", help="artifact folder to write (with --export: the .gguf file, or a new folder)"
        ),
    ] = None,
    export: Annotated[
        str | None,
        typer.Option(
            "--export",
            help="write another engine's format instead of an artifact: gguf (llama.cpp: int8 as Q8_0, int4 "
            "sym/asym as Q4_0/Q4_1) or compressed-tensors (transformers, vLLM); never overwrites --out",
        ),
    ] = None,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="progress bars")] = True,
) -> None:
    """Calibrate, plan and quantize a model into an artifact folder that loads without recalibrating, or export
    the quantized model (--export gguf --out model.gguf, --export compressed-tensors --out DIR)."""
    if config is None or out_dir is None:
        raise ValueError("give --config QUANT.yaml and --out DIR (example configs: examples/quant/*.yaml)")
    result = compile_model(model, config, out_dir, progress=progress, console=out, export=export)
    if export is None:
        out.print(f"wrote {result} (load it with Pipeline(model={str(result)!r}) or --model {result})")
        return
    out.print(f"wrote {result.path} ({export})")
    for line in result.summary():
        out.print(f"  {line}", highlight=False, markup=False)
