"""QBench: workloads, peers (HF transformers, llama.cpp), benchmark runs and their reports.

Nothing heavy is imported here; ``mcp2026.bench.cli.bench_app`` is the ``mcp2026 bench`` sub-command.
"""
