"""The export formats by name (``mcp2026 compile --export NAME``): each writes a loaded model and reports how."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from mcp2026.errors import ExportError
from mcp2026.export.compressed_tensors import export_compressed_tensors
from mcp2026.export.gguf_export import export_gguf
from mcp2026.export.report import ExportReport, check_new_path

EXPORTERS: dict[str, Callable[[Any, str | Path], ExportReport]] = {
    "gguf": export_gguf,
    "compressed-tensors": export_compressed_tensors,
}
SUFFIXES = {"gguf": ".gguf", "compressed-tensors": None}  # None: a folder


def check_export(fmt: str, out: str | Path) -> None:
    """Fail before any work on an unknown format or an output path an export would refuse."""
    if fmt not in EXPORTERS:
        raise ExportError(f"unknown export format {fmt!r}; known: {', '.join(EXPORTERS)}")
    check_new_path(out, SUFFIXES[fmt])


def export_model(loaded: Any, fmt: str, out: str | Path) -> ExportReport:
    """Write ``loaded`` (a ``loading.loader.LoadedModel``) as ``fmt`` to ``out``."""
    check_export(fmt, out)
    return EXPORTERS[fmt](loaded, out)
