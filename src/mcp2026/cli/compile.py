"""``mcp2026 compile`` (alias ``mcp-compile``): calibrate, plan and quantize a model into an artifact folder."""

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
    out_dir: Annotated[Path | None, typer.Option("--out", help="artifact folder to write")] = None,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="progress bars")] = True,
) -> None:
    """Calibrate, plan and quantize a model into an artifact folder that loads without recalibrating."""
    if config is None or out_dir is None:
        raise ValueError("give --config QUANT.yaml and --out DIR (example configs: examples/quant/*.yaml)")
    path = compile_model(model, config, out_dir, progress=progress, console=out)
    out.print(f"wrote {path} (load it with Pipeline(model={str(path)!r}) or --model {path})")
