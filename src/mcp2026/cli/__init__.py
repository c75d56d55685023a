"""Command line: ``mcp2026 generate | info | serve | compile | bench | doctor | canary | kv``. Each command lives
in its own module, imported when the command runs (cli_lazy), so this one stays light. Errors print one line
and exit 2."""

from __future__ import annotations

import sys

import typer

from mcp2026.cli_lazy import LazyCommand, lazy_group

COMMANDS = lazy_group(
    LazyCommand(
        "generate", "mcp2026.cli.generate:generate", "Stream a completion of PROMPT to the terminal."
    ),
    LazyCommand(
        "info",
        "mcp2026.cli.info:info",
        "Architecture, parameter count, tensor formats, the weights path and kernels it runs, memory "
        "footprint.",
    ),
    LazyCommand(
        "serve",
        "mcp2026.serve.cli:serve",
        "Serve the model over an OpenAI-compatible HTTP API (completions, chat, models, metrics).",
    ),
    LazyCommand(
        "compile",
        "mcp2026.cli.compile:compile_cmd",
        "Calibrate, plan and quantize a model into an artifact folder that loads without recalibrating, or export "
        "the quantized model (--export gguf --out model.gguf, --export compressed-tensors --out DIR).",
    ),
    LazyCommand(
        "bench",
        "mcp2026.bench.cli:bench_app",
        "QBench: benchmarks of mcp2026 side by side with HF transformers and llama.cpp, same run.",
    ),
    LazyCommand(
        "doctor",
        "mcp2026.doctor.cli:doctor",
        "Pre-flight checks: PASS / WARN / FAIL with a reason and a fix each; exit code 1 on any FAIL.",
    ),
    LazyCommand(
        "canary",
        "mcp2026.bench.canary_cli:canary_app",
        "Release gate: run two configurations on the same requests (interleaved) and decide PROMOTE / HOLD / "
        "ROLLBACK from P99 latency change, accuracy delta and memory bandwidth utilisation.",
    ),
    LazyCommand(
        "kv", "mcp2026.bench.kv_calibrate_cli:kv_app", "KV cache tools: per-layer budget calibration"
    ),
)

app = typer.Typer(
    cls=COMMANDS,
    add_completion=False,
    no_args_is_help=True,
    help="mcp2026: Model-Centric Pipeline inference engine",
)


@app.callback()
def _group() -> None:
    """mcp2026: Model-Centric Pipeline inference engine"""


def main() -> None:
    app()


def compile_main() -> None:
    """``mcp-compile``: an alias of ``mcp2026 compile``."""
    typer.main.get_command(app).main(args=["compile", *sys.argv[1:]], prog_name="mcp-compile")
