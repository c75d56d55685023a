"""``mcp2026 bench speculative``: single-stream decode with prompt-lookup drafts, beside plain decode and llama.cpp."""

from __future__ import annotations

from typing import Annotated

import typer

from mcp2026.bench.cli_common import (
    DocsOpt,
    ModelOpt,
    OutOpt,
    PeerOpt,
    ProgressOpt,
    finish_run,
    progress_bars,
)
from mcp2026.bench.speculative import SpeculativeBenchConfig, run_speculative
from mcp2026.cli_errors import user_errors
from mcp2026.config import SpeculativeConfig


@user_errors
def speculative(
    model: ModelOpt = None,
    num_grounded: Annotated[
        int, typer.Option(help="input-grounded prompts (rewrite / summarise / extract)")
    ] = 9,
    num_chat: Annotated[int, typer.Option(help="free-form chat prompts")] = 6,
    new_tokens: Annotated[int, typer.Option(help="tokens generated at most per request")] = 128,
    num_tokens: Annotated[
        int, typer.Option(help="the most draft tokens per step")
    ] = SpeculativeConfig().num_tokens,
    peer: PeerOpt = True,
    write_docs: DocsOpt = False,
    out_dir: OutOpt = None,
    progress: ProgressOpt = True,
) -> None:
    """Single-stream decode with prompt-lookup drafts vs without and vs llama.cpp, on input-grounded and
    free-form chat prompts."""
    config = SpeculativeBenchConfig(model, num_grounded, num_chat, new_tokens, num_tokens, peer)
    with progress_bars(progress) as bar:
        run = run_speculative(config, bar)
    finish_run(run, out_dir, write_docs, "speculative")
