"""``mcp2026 bench serve``: the serving load generator against a running OpenAI-compatible server (ours,
llama.cpp's ``llama-server``, vLLM), alone or side by side with peers (``--peer-url NAME=URL``: the same
workload, interleaved, reported as ratios). Listed on the bench app by bench/cli.py.
"""

from __future__ import annotations

import math
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from mcp2026.bench.report import render_markdown, shell_join, write_run
from mcp2026.bench.serve import bench_serve
from mcp2026.bench.serve_config import ServeBenchConfig, parse_extra_body, parse_goodput, parse_peers
from mcp2026.bench.workloads import WorkloadSpec, load_workload, workload_burstiness
from mcp2026.cli_errors import err
from mcp2026.loading.loader import default_model_path
from mcp2026.loading.tokenizer import Tokenizer

out = Console(emoji=False)


def load_tokenizer(tokenizer_path: str | None) -> Any:
    """Our tokenizer: the default model's unless ``tokenizer_path`` (a .gguf or an HF folder)."""
    path = Path(tokenizer_path) if tokenizer_path else default_model_path()
    return Tokenizer.from_hf_dir(path) if path.is_dir() else Tokenizer.from_gguf(path)


def load_requests(
    workload: str,
    num_prompts: int,
    seed: int,
    input_len: int,
    output_len: int,
    tokenizer_path: str | None,
    tokenizer: Any = None,
) -> list[Any]:
    """Sample the workload with our tokenizer (``tokenizer``, else ``load_tokenizer(tokenizer_path)``), so
    every engine under test gets the same token ids."""

    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(tokenizer_path)
    spec = WorkloadSpec(workload, num_prompts, seed, input_len=input_len, output_len=output_len)
    return load_workload(spec, tokenizer)


def serve(
    base_url: Annotated[
        str, typer.Option(help="the server, e.g. http://127.0.0.1:8000")
    ] = "http://127.0.0.1:8000",
    model: Annotated[
        str | None, typer.Option(help="model id to send (default: the first of /v1/models)")
    ] = None,
    api_key: Annotated[str | None, typer.Option(envvar="MCP2026_API_KEY", help="Bearer key")] = None,
    workload: Annotated[str, typer.Option(help="sharegpt | bursty | random | prefix | long")] = "sharegpt",
    num_prompts: Annotated[int, typer.Option(help="requests to sample")] = 200,
    input_len: Annotated[int, typer.Option(help="random workload: prompt tokens")] = 128,
    output_len: Annotated[int, typer.Option(help="random/prefix/long workloads: output tokens")] = 128,
    tokenizer: Annotated[
        str | None,
        typer.Option(help="tokenizer for sampling (.gguf or HF folder; default: embedded model's)"),
    ] = None,
    request_rate: Annotated[float, typer.Option(help="requests/s (inf: all at once)")] = math.inf,
    burstiness: Annotated[
        float | None, typer.Option(help="Gamma shape: 1 = Poisson, < 1 burstier (default: the workload's)")
    ] = None,
    max_concurrency: Annotated[int | None, typer.Option(help="requests in flight at most")] = None,
    duration: Annotated[
        float | None, typer.Option(help="seconds: cycle the requests until then instead of sending each once")
    ] = None,
    goodput: Annotated[
        list[str] | None,
        typer.Option(
            help="SLOs for goodput: NAME:MS with NAME ttft, tpot or e2el; several after one flag as in vLLM "
            "(--goodput ttft:1000 tpot:100), repeated, or comma-separated"
        ),
    ] = None,
    disconnect_share: Annotated[float, typer.Option(help="share of clients leaving mid-stream")] = 0.0,
    malformed_share: Annotated[float, typer.Option(help="share of malformed requests mixed in")] = 0.0,
    check_server: Annotated[
        bool,
        typer.Option("--check-server/--no-check-server", help="afterwards: our /metrics shows nothing held"),
    ] = False,
    peer_url: Annotated[
        list[str] | None,
        typer.Option(
            help="side by side: NAME=URL of another OpenAI-compatible server (repeatable), e.g. "
            "llama=http://127.0.0.1:8012; same workload, interleaved, ratios ours / peer"
        ),
    ] = None,
    peer_model: Annotated[
        list[str] | None,
        typer.Option(
            help="NAME=MODEL: the model id to send that peer (default: the first of its /v1/models)"
        ),
    ] = None,
    peer_body: Annotated[
        list[str] | None,
        typer.Option(
            help="NAME=JSON (or NAME=@FILE): fields merged into every request to that peer, e.g. a "
            "response_format; the peer may be our own server under another name"
        ),
    ] = None,
    extra_body: Annotated[
        str | None,
        typer.Option(help="JSON (or @FILE): fields merged into every request to our server"),
    ] = None,
    rounds: Annotated[
        int,
        typer.Option(help="side by side: phases per endpoint (order A B | B A | ...; duration split evenly)"),
    ] = 2,
    seed: Annotated[int, typer.Option(help="workload, arrivals and client-behaviour seed")] = 0,
    detailed: Annotated[bool, typer.Option("--detailed/--no-detailed", help="keep per-token ITLs")] = False,
    out_dir: Annotated[
        Path | None, typer.Option("--out", help="folder for the run's JSON and markdown")
    ] = None,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="show a progress bar")] = True,
    more_slos: Annotated[
        list[str] | None,
        typer.Argument(hidden=True, help="the values after --goodput's first (vLLM's nargs='+' syntax)"),
    ] = None,
) -> None:
    """Serving benchmark with vLLM bench-serve metrics: TTFT, TPOT, ITL, E2E, throughput and goodput."""
    try:
        if more_slos and not goodput:
            raise ValueError(f"unexpected argument(s) {' '.join(more_slos)}: bench serve takes only options")
        config = ServeBenchConfig(
            base_url=base_url.rstrip("/"),
            model=model,
            api_key=api_key,
            request_rate=request_rate,
            burstiness=burstiness if burstiness is not None else workload_burstiness(workload),
            max_concurrency=max_concurrency,
            seed=seed,
            duration_s=duration,
            goodput_ms=parse_goodput([*(goodput or []), *(more_slos or [])]),
            disconnect_share=disconnect_share,
            malformed_share=malformed_share,
            check_server=check_server,
            detailed=detailed,
            peers=parse_peers(peer_url or [], peer_model or [], peer_body or []),
            rounds=rounds,
            extra_body=parse_extra_body(extra_body, "--extra-body") if extra_body else {},
        )
        tok = load_tokenizer(tokenizer)
        requests = load_requests(workload, num_prompts, seed, input_len, output_len, tokenizer, tok)
        if config.peers and duration is None and rounds > len(requests):
            raise ValueError(f"--rounds {rounds} needs at least as many requests, got {len(requests)}")
    except (ValueError, FileNotFoundError) as e:
        err.print(f"[bold red]error:[/] {e}", highlight=False)
        raise typer.Exit(2) from None
    bar: Any = nullcontext(None)
    if progress:
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        bar = Progress(*columns, console=err)
    command = shell_join(["mcp2026", "bench", "serve", *sys.argv[3:]]) if len(sys.argv) > 2 else ""
    try:
        with bar as p:
            run = bench_serve(
                config,
                requests,
                p,
                command=command,
                count_tokens=lambda text: len(tok.encode(text, add_special_tokens=False)),
                log=lambda line: err.print(line, style="yellow", markup=False, highlight=False),
            )
    except (httpx.HTTPError, ValueError) as e:  # an unreachable server is one line, not a traceback
        err.print(f"[bold red]error:[/] {base_url}: {e}", highlight=False)
        raise typer.Exit(2) from None
    out.print(render_markdown(run), markup=False, highlight=False)
    path = write_run(run, out_dir)
    err.print(f"[dim]wrote {path} and {path.with_suffix('.md').name}[/]")
    if check_server and not run.aggregates["server_after"]["idle"]:
        err.print(f"[bold red]the server did not go idle:[/] {run.aggregates['server_after']}")
        raise typer.Exit(1)


serve_app = typer.Typer(add_completion=False, help="serving load generator")
serve_app.command("serve")(serve)
