"""Command line: ``mcp2026 generate | info | ...`` (typer). Errors print one line and exit 2."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from mcp2026.cli_errors import err, user_errors

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="mcp2026: Model-Centric Pipeline inference engine"
)
out = Console(emoji=False)

ModelOpt = Annotated[
    Path | None,
    typer.Option("--model", "-m", help="HF model folder or .gguf file (default: embedded SmolLM2-135M)"),
]


@app.command()
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
    stats: Annotated[bool, typer.Option("--stats/--no-stats", help="print speed after the answer")] = True,
) -> None:
    """Stream a completion of PROMPT to the terminal."""
    from mcp2026.pipeline import Pipeline
    from mcp2026.types import SamplingParams

    params = SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed
    )
    pipe = Pipeline(model=model, dtype=dtype)
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
        err.print(
            f"[dim]{n} tokens, finish={final.finish_reason}, TTFT {ttft * 1e3:.0f} ms, decode {rate:.1f} tok/s, "
            f"{str(pipe.dtype).removeprefix('torch.')}[/]"
        )


@app.command()
@user_errors
def info(
    model: Annotated[Path | None, typer.Argument(help="HF folder or .gguf (default: embedded model)")] = None,
    dtype: Annotated[str, typer.Option(help="auto | fp32 | bf16, as for generate and serve")] = "auto",
) -> None:
    """Architecture, parameter count, tensor formats, the weights path and kernels it runs, memory footprint."""
    from rich.table import Table

    from mcp2026.loading.loader import load_model, parameter_count, weight_bytes
    from mcp2026.pipeline import native_weights_blocker, resolve_dtype
    from mcp2026.quant.block_linear import BlockLinear, block_kernel

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


@app.command()
@user_errors
def serve(
    model: ModelOpt = None,
    host: Annotated[str | None, typer.Option(help="address to bind (default 127.0.0.1)")] = None,
    port: Annotated[int | None, typer.Option(help="port (default 8000)")] = None,
    tenants: Annotated[Path | None, typer.Option("--tenants", help="API keys -> tenants YAML")] = None,
    config: Annotated[
        Path | None, typer.Option("--config", help="serve YAML (same keys as these options)")
    ] = None,
    ssl_certfile: Annotated[Path | None, typer.Option(help="TLS certificate (PEM)")] = None,
    ssl_keyfile: Annotated[Path | None, typer.Option(help="TLS private key (PEM)")] = None,
    cors_origin: Annotated[
        list[str] | None, typer.Option(help="allow browser requests from this origin (repeatable; '*' any)")
    ] = None,
    max_request_body: Annotated[
        int | None, typer.Option(help="largest request body in bytes; larger ones get a 413 (16 MiB)")
    ] = None,
    dtype: Annotated[str | None, typer.Option(help="auto | fp32 | bf16")] = None,
    device: Annotated[str | None, typer.Option(help="cpu (default) | cuda | cuda:N")] = None,
    otlp_traces_endpoint: Annotated[
        str | None,
        typer.Option(help="send OpenTelemetry request spans to this OTLP endpoint (needs mcp2026[otel])"),
    ] = None,
    served_model_name: Annotated[str | None, typer.Option(help="the model id clients send")] = None,
    quant: Annotated[
        Path | None, typer.Option("--quant", help="quant YAML (as for compile): quantize the weights at load")
    ] = None,
    kv_dtype: Annotated[
        str | None, typer.Option(help="KV cache storage: fp32 | bf16 | fp16 | int8 | fp8 | int4 | int4-g64")
    ] = None,
    kv_policy: Annotated[
        str | None,
        typer.Option(
            help="KV eviction for long contexts: none | sink_window | heavy_hitter | snap | dynamic_window"
        ),
    ] = None,
    kv_sparsity: Annotated[
        float | None, typer.Option(help="fraction of each long context the KV policy drops (0.7 if unset)")
    ] = None,
    kv_layer_weights: Annotated[
        str | None,
        typer.Option(
            help="per-layer KV budgets: auto (default: the preset calibrated for this model and policy, else "
            "uniform) | uniform | a preset (smollm2-135m) | a calibration file (.json) | 'w0/w1/...'"
        ),
    ] = None,
    gate: Annotated[
        str | None,
        typer.Option(help="what traffic pressure switches: auto | quant | kv | observe | off"),
    ] = None,
    canary_config: Annotated[
        Path | None, typer.Option("--canary-config", help="live canary: the candidate's serve YAML")
    ] = None,
    candidate_share: Annotated[
        float | None, typer.Option(help="live canary: share of tenants routed to the candidate (0.1)")
    ] = None,
    log_level: Annotated[str, typer.Option(help="debug | info | warning")] = "info",
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API (completions, chat, models, metrics)."""
    import dataclasses
    import logging

    from mcp2026.config import EngineConfig
    from mcp2026.serve.config import ServeConfig, kv_compressor_from_options, load_serve_yaml
    from mcp2026.serve.server import build_server

    serve_config, engine_config = load_serve_yaml(config) if config else (ServeConfig(), EngineConfig())
    given = {
        "model": model,
        "host": host,
        "port": port,
        "tenants_file": tenants,
        "ssl_certfile": ssl_certfile,
        "ssl_keyfile": ssl_keyfile,
        "cors_origins": tuple(cors_origin) if cors_origin else None,
        "max_request_body_bytes": max_request_body,
        "dtype": dtype,
        "device": device,
        "otlp_traces_endpoint": otlp_traces_endpoint,
        "model_name": served_model_name,
        "quant": quant,
    }
    overrides = {k: str(v) if isinstance(v, Path) else v for k, v in given.items() if v is not None}
    serve_config = dataclasses.replace(serve_config, **overrides)
    canary = serve_config.canary.with_live_options(canary_config, candidate_share)
    serve_config = dataclasses.replace(serve_config, canary=canary)
    if gate is not None:
        serve_config = dataclasses.replace(
            serve_config, traffic=dataclasses.replace(serve_config.traffic, gate=gate)
        )
    compressor = kv_compressor_from_options(engine_config, kv_dtype, kv_policy, kv_sparsity, kv_layer_weights)
    engine_config = dataclasses.replace(engine_config, kv_compressor=compressor)
    if not serve_config.is_loopback and serve_config.tenants_file is None:
        err.print(
            f"[bold yellow]warning:[/] binding {serve_config.host} without API keys: anyone who can reach this "
            "address can use the server (pass --tenants FILE)",
            highlight=False,
        )
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server = build_server(serve_config, engine_config, log_level=log_level)
    server.run()


@app.command("compile")
@user_errors
def compile_cmd(
    model: Annotated[
        Path | None, typer.Argument(help="HF folder or .gguf to quantize (default: embedded SmolLM2-135M)")
    ] = None,
    config: Annotated[
        Path | None, typer.Option("--config", help="quantization YAML (see examples/quant/)")
    ] = None,
    out_dir: Annotated[Path | None, typer.Option("--out", help="artifact folder to write")] = None,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="progress bars")] = True,
) -> None:
    """Calibrate, plan and quantize a model into an artifact folder that loads without recalibrating."""
    from mcp2026.compiler import compile_model

    if config is None or out_dir is None:
        raise ValueError("give --config QUANT.yaml and --out DIR (example configs: examples/quant/*.yaml)")
    path = compile_model(model, config, out_dir, progress=progress, console=out)
    out.print(f"wrote {path} (load it with Pipeline(model={str(path)!r}) or --model {path})")


def _register_bench() -> None:
    from mcp2026.bench.cli import bench_app

    try:  # the load generator lives in its own module (it needs httpx)
        from mcp2026.bench.serve_cli import serve as bench_serve

        bench_app.command("serve")(bench_serve)
    except ImportError:
        pass
    app.add_typer(bench_app, name="bench", help="QBench: latency, offline throughput, serving load, reports")


_register_bench()
from mcp2026.doctor.cli import register as register_doctor  # noqa: E402

register_doctor(app)
from mcp2026.bench.canary_cli import register as register_canary  # noqa: E402

register_canary(app)
from mcp2026.bench.kv_calibrate_cli import register as register_kv  # noqa: E402

register_kv(app)


def main() -> None:
    app()


def compile_main() -> None:
    """``mcp-compile``: an alias of ``mcp2026 compile``."""
    typer.main.get_command(app).main(args=["compile", *sys.argv[1:]], prog_name="mcp-compile")


if __name__ == "__main__":
    main()
