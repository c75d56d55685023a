"""``mcp2026 info [MODEL]``: what a model file holds and how we would run it, without generating."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from mcp2026.cli_errors import user_errors
from mcp2026.loading.loader import load_model, parameter_count, weight_bytes
from mcp2026.pipeline import native_weights_blocker, resolve_dtype
from mcp2026.quant.block_linear import BlockLinear, block_kernel

out = Console(emoji=False)


@user_errors
def info(
    model: Annotated[Path | None, typer.Argument(help="HF folder or .gguf (default: embedded model)")] = None,
    dtype: Annotated[str, typer.Option(help="auto | fp32 | bf16, as for generate and serve")] = "auto",
) -> None:
    """Architecture, parameter count, tensor formats, the weights path and kernels it runs, memory footprint."""
    blocker = native_weights_blocker(model, dtype, None, "cpu")
    compute_dtype = resolve_dtype(dtype, None)
    loaded = load_model(model, compute_dtype, native=blocker is None)
    cfg = loaded.config
    blocks = [m for m in loaded.model.modules() if isinstance(m, BlockLinear)]
    if blocks:
        formats = sorted({f for m in blocks for f in m.formats})
        weights = f"native: {', '.join(formats)} as stored, {block_kernel()}; the rest {_name(compute_dtype)}"
    else:
        weights = f"float {_name(compute_dtype)}" + (f" ({blocker})" if blocker else "")
    kv_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * compute_dtype.itemsize
    table = Table(title=str(loaded.source), show_header=False)
    rows = [
        ("architecture", cfg.architecture),
        ("parameters", f"{parameter_count(loaded.model) / 1e6:.1f} M"),
        ("layers / hidden / ffn", f"{cfg.num_layers} / {cfg.hidden_size} / {cfg.intermediate_size}"),
        ("heads (q / kv) x dim", f"{cfg.num_heads} / {cfg.num_kv_heads} x {cfg.head_dim}"),
        ("vocab", str(cfg.vocab_size)),
        ("context", str(cfg.max_position_embeddings)),
        ("rope", f"theta={cfg.rope_theta:g}" + (f" scaling={cfg.rope_scaling}" if cfg.rope_scaling else "")),
        ("tied embeddings", str(cfg.tie_word_embeddings)),
        ("file", f"{loaded.file_format}, {loaded.file_bytes / 2**20:.1f} MiB"),
        ("stored tensor formats", ", ".join(f"{k} x{v}" for k, v in sorted(loaded.tensor_formats.items()))),
        ("weights", weights),
        ("weights in memory", f"{weight_bytes(loaded.model) / 2**20:.1f} MiB"),
        (f"KV cache per token ({_name(compute_dtype)})", f"{kv_bytes / 1024:.1f} KiB"),
    ]
    for k, v in rows:
        table.add_row(k, v)
    out.print(table)


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")
