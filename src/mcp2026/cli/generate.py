"""``mcp2026 generate PROMPT``: stream one completion to the terminal, then its speed."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from mcp2026.cli_errors import err, user_errors
from mcp2026.pipeline import Pipeline
from mcp2026.types import SamplingParams

ModelOpt = Annotated[
    Path | None,
    typer.Option("--model", "-m", help="HF model folder or .gguf file (default: embedded SmolLM2-135M)"),
]


@user_errors
def generate(
    prompt: Annotated[str, typer.Argument(help="the prompt (a user message with --chat)")],
    model: ModelOpt = None,
    chat: Annotated[bool, typer.Option("--chat/--no-chat", help="apply the model's chat template")] = True,
    max_tokens: Annotated[int, typer.Option(help="tokens to generate at most")] = 256,
    temperature: Annotated[float, typer.Option(help="0 = greedy")] = 0.0,
    top_p: Annotated[float, typer.Option()] = 1.0,
    top_k: Annotated[int, typer.Option()] = 0,
    seed: Annotated[int | None, typer.Option()] = None,
    dtype: Annotated[str, typer.Option(help="auto | fp32 | bf16")] = "auto",
    speculative: Annotated[
        str, typer.Option(help="speculative decoding: ngram (prompt lookup, exact; default) | off")
    ] = "ngram",
    stats: Annotated[bool, typer.Option("--stats/--no-stats", help="print speed after the answer")] = True,
) -> None:
    """Stream a completion of PROMPT to the terminal."""
    params = SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed
    )
    pipe = Pipeline(model=model, dtype=dtype, speculative=speculative)
    engine = pipe.engine
    request_id = engine.add_request(pipe.encode(prompt, chat), params)
    final = None
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == request_id:
                sys.stdout.write(o.delta_text)
                sys.stdout.flush()
                final = o if o.finished else final
    sys.stdout.write("\n")
    if stats and final is not None and final.first_token_time is not None:
        n = len(final.output.token_ids)
        ttft = final.first_token_time - final.arrival_time
        decode = final.finish_time - final.first_token_time
        rate = (n - 1) / decode if n > 1 and decode > 0 else float("nan")
        spec = engine.speculation
        drafts = (
            f", {spec['tokens_per_draft']:.2f} tokens per drafted step"
            if spec.get("tokens_per_draft") is not None
            else ""
        )
        err.print(
            f"[dim]{n} tokens, finish={final.finish_reason}, TTFT {ttft * 1e3:.0f} ms, decode {rate:.1f} tok/s, "
            f"{str(pipe.dtype).removeprefix('torch.')}{drafts}[/]"
        )
