"""``mcp2026 serve``: the OpenAI-compatible HTTP server, configured from a serve YAML and/or options."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Annotated

import typer

from mcp2026 import hardware
from mcp2026.cli_errors import err, user_errors
from mcp2026.config import EngineConfig
from mcp2026.serve.config import ServeConfig, kv_compressor_from_options, load_serve_yaml
from mcp2026.serve.server import build_server

ModelOpt = Annotated[
    Path | None,
    typer.Option("--model", "-m", help="HF model folder or .gguf file (default: embedded SmolLM2-135M)"),
]


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
    speculative: Annotated[
        str | None, typer.Option(help="speculative decoding: ngram (prompt lookup, exact; default) | off")
    ] = None,
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
    if speculative is not None:
        engine_config = dataclasses.replace(
            engine_config, speculative=dataclasses.replace(engine_config.speculative, method=speculative)
        )
    if not serve_config.is_loopback and serve_config.tenants_file is None:
        err.print(
            f"[bold yellow]warning:[/] binding {serve_config.host} without API keys: anyone who can reach this "
            "address can use the server (pass --tenants FILE)",
            highlight=False,
        )
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    hardware.return_large_blocks_at_once()  # this process serves: temporaries do not linger in the heap
    server = build_server(serve_config, engine_config, log_level=log_level)
    server.run()
