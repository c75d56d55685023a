"""``mcp2026 bench latency | offline | report | ...``: run a benchmark against its peers in the same process, print
the table, write runs/<time>-<kind>.json + .md, optionally refresh docs/benchmarks.md. Each command lives in its
own module, imported when it runs (cli_lazy), so listing them loads neither torch nor the peers.
"""

from __future__ import annotations

import typer

from mcp2026.cli_lazy import LazyCommand, lazy_group

COMMANDS = lazy_group(
    LazyCommand(
        "latency",
        "mcp2026.bench.latency_cli:latency",
        "Single-stream decode and prefill tok/s: ours vs HF transformers (interleaved, median of repeats).",
    ),
    LazyCommand(
        "speculative",
        "mcp2026.bench.speculative_cli:speculative",
        "Single-stream decode with prompt-lookup drafts vs without and vs llama.cpp, on input-grounded and "
        "free-form chat prompts.",
    ),
    LazyCommand(
        "soak",
        "mcp2026.bench.soak_cli:soak",
        "Start-up seconds and RSS over time of `mcp2026 serve` under long ShareGPT load with hang-ups and "
        "malformed requests.",
    ),
    LazyCommand(
        "offline",
        "mcp2026.bench.offline_cli:offline",
        "Offline throughput: all requests at once on our engine vs HF static batches (and, for batched decode, "
        "llama.cpp and vLLM CPU), same prompts.",
    ),
    LazyCommand(
        "report",
        "mcp2026.bench.report_cli:report",
        "Print earlier runs' summaries; write report.md with plots (latency CDFs, throughput vs rate, Pareto "
        "fronts, bit plan heatmap, KV usage over time).",
    ),
    LazyCommand(
        "quality",
        "mcp2026.bench.quality_cli:quality",
        "Perplexity and KLD of quantized plans (int8, int4, role mixture, DQG budgets) vs full precision, with "
        "HF transformers, llama.cpp and llama.cpp's own formats scored on the same windows.",
    ),
    LazyCommand(
        "export",
        "mcp2026.bench.export_cli:export",
        "A plan exported to GGUF: its perplexity in llama.cpp against ours on the same held-out windows.",
    ),
    LazyCommand(
        "sweep",
        "mcp2026.bench.sweep_cli:sweep",
        "Serve each configuration at each request rate; table, Pareto fronts and plots.",
    ),
    LazyCommand(
        "plugin",
        "mcp2026.bench.plugin_cli:plugin",
        "Run a custom benchmark plugin (init, then run returning named numbers) and record it like the others.",
    ),
    LazyCommand(
        "kv",
        "mcp2026.bench.kv_cli:kv",
        "KV compression: ΔPPL / KLD per codec and eviction policy, retrieval agreement, KV bytes and max "
        "concurrent sequences, decode tok/s with eviction, each vs uncompressed in the same engine.",
    ),
    LazyCommand(
        "headline",
        "mcp2026.bench.headline_cli:headline",
        "The headline table (ours vs HF transformers, llama.cpp, vLLM) from the newest run of each kind.",
    ),
    LazyCommand(
        "gpu",
        "mcp2026.bench.gpu_cli:gpu",
        "The GPU check: exactness against HF transformers and speed beside it on one CUDA GPU (SmolLM2-135M's "
        "shape, random weights, built in the run: no network, no model file).",
    ),
    LazyCommand(
        "serve",
        "mcp2026.bench.serve_cli:serve",
        "Serving benchmark with vLLM bench-serve metrics: TTFT, TPOT, ITL, E2E, throughput and goodput.",
    ),
)

bench_app = typer.Typer(cls=COMMANDS, add_completion=False, no_args_is_help=True)


@bench_app.callback()
def _group() -> None:
    """QBench: benchmarks of mcp2026 side by side with HF transformers and llama.cpp, same run."""
