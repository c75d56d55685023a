"""``python -m mcp2026.cli``: the ``mcp2026`` command."""

from mcp2026.cli import main

main()
