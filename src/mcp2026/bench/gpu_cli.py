"""``mcp2026 bench gpu``: the GPU check (bench/gpu_check.py) from the command line."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from mcp2026.bench import gpu_check
from mcp2026.cli_errors import user_errors


@user_errors
def gpu(
    out: Annotated[Path | None, typer.Option(help="write the JSON results here too")] = None,
    docs: Annotated[Path | None, typer.Option(help="rewrite this markdown file's gpu-check section")] = None,
    quick: Annotated[bool, typer.Option(help="skip the 256-sequence and quantized runs")] = False,
) -> None:
    """The GPU check: exactness against HF transformers and speed beside it on one CUDA GPU (SmolLM2-135M's
    shape, random weights, built in the run: no network, no model file)."""
    gpu_check.main(
        [
            *(["--out", str(out)] if out else []),
            *(["--docs", str(docs)] if docs else []),
            *(["--quick"] if quick else []),
        ]
    )
