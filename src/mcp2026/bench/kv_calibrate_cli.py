"""``mcp2026 kv calibrate``: per-layer KV budgets measured for a model (bench.kv_calibrate), written as a file that
``--kv-layer-weights FILE`` / ``layer_weights: FILE`` take, or installed for ``layer_weights="auto"``."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from mcp2026.bench.kv_calibrate import CalibrationConfig
from mcp2026.bench.kv_calibrate import calibrate as calibrate_layers
from mcp2026.cli_errors import err, user_errors
from mcp2026.kv.layer_weights import calibrations_dir, fingerprint
from mcp2026.loading.loader import load_model
from mcp2026.pipeline import DTYPES

kv_app = typer.Typer(add_completion=False, no_args_is_help=True)


@kv_app.callback()
def _group() -> None:
    """KV cache tools: per-layer budget calibration"""


@kv_app.command()
@user_errors
def calibrate(
    model: Annotated[
        Path | None,
        typer.Option("--model", "-m", help="HF model folder or .gguf file (default: embedded SmolLM2-135M)"),
    ] = None,
    policy: Annotated[str, typer.Option(help="the eviction policy the weights are for")] = "heavy_hitter",
    sparsity: Annotated[
        float, typer.Option(help="fraction each probe drops (the budget you will serve)")
    ] = 0.7,
    texts: Annotated[
        int, typer.Option("--texts", help="calibration texts (each costs a pass per layer group)")
    ] = 2,
    context_tokens: Annotated[int, typer.Option(help="tokens per calibration text")] = 2048,
    text: Annotated[
        str,
        typer.Option(
            help="sharegpt (held-out conversations) | random | a UTF-8 text file of your own traffic"
        ),
    ] = "sharegpt",
    seed: Annotated[int, typer.Option(help="which conversations (the kv bench evaluates on seed 0)")] = 1,
    dtype: Annotated[str, typer.Option(help="activation dtype: fp32 | bf16")] = "fp32",
    out: Annotated[Path, typer.Option("--out", help="the calibration file to write")] = Path(
        "kv-layer-weights.json"
    ),
    install: Annotated[
        bool,
        typer.Option(
            "--install/--no-install",
            help="also install it, so layer_weights='auto' (the default) uses it for this model and policy",
        ),
    ] = False,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="show a progress bar")] = True,
) -> None:
    """Measure each layer's sensitivity to eviction on this model (only that layer evicts, ΔPPL against the
    uncompressed cache) and derive per-layer budget weights from it. SmolLM2-135M, two 2k texts: 7.5 minutes
    on 2 CPU cores."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    config = CalibrationConfig(policy, sparsity, context_tokens, texts, text, seed)
    if out.suffix != ".json":
        raise ValueError(f"--out must name a .json file, got {out}")
    loaded = load_model(model, dtype=DTYPES[dtype])
    if context_tokens > loaded.config.max_position_embeddings:
        raise ValueError(
            f"--context-tokens {context_tokens} exceeds the model's context ({loaded.config.max_position_embeddings})"
        )
    label = str(model) if model is not None else "embedded SmolLM2-135M-Instruct"
    with Progress(console=err, disable=not progress, transient=True) as bar:
        task = bar.add_task("probing layers", total=None)
        result = calibrate_layers(loaded, config, label, advance=lambda: bar.advance(task))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    console = Console(emoji=False)
    console.print(_table(result))
    console.print(f"wrote {out}: use it with --kv-layer-weights {out} (serve) or layer_weights: {out} (YAML)")
    if install:
        folder = calibrations_dir()
        folder.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256(json.dumps(fingerprint(loaded.config), sort_keys=True).encode()).hexdigest()
        name = f"{policy}-{digest[:12]}.json"  # one per model shape and policy: a new calibration replaces it
        shutil.copyfile(out, folder / name)
        console.print(
            f"installed {folder / name}: layer_weights='auto' now takes it for this model and {policy}"
        )


def _table(result: dict) -> Table:
    probes = result["probes_delta_ppl_pct"]
    table = Table(
        title=f"per-layer sensitivity ({result['policy']} at {result['calibration']['sparsity']:g})"
    )
    table.add_column("layer")
    for t in range(len(probes)):
        table.add_column(f"ΔPPL text {t}")
    table.add_column("weight")
    for layer, weight in enumerate(result["weights"]):
        table.add_row(str(layer), *(f"{p[layer]:+.3g}%" for p in probes), f"{weight:.3g}")
    return table
