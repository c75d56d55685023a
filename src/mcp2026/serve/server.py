"""Run the server: load the model, build the app, serve with uvicorn; SIGTERM drains or aborts by config.

The first SIGTERM/SIGINT marks the server draining (new requests get 503, /readyz fails), then either lets
in-flight requests finish (``drain_on_sigterm``) or aborts them (finish_reason "abort"), and exits 0.
A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

from mcp2026.config import EngineConfig
from mcp2026.engine.async_engine import AsyncEngine
from mcp2026.engine.compute_thread import ComputeThread
from mcp2026.pipeline import Pipeline
from mcp2026.serve.app import create_app
from mcp2026.serve.canary import build_router, read_candidate
from mcp2026.serve.config import ServeConfig, load_quant_spec
from mcp2026.serve.tracing import Tracing
from mcp2026.serve.traffic import Gate, KVPolicyGate, ObserveGate

if TYPE_CHECKING:
    from mcp2026.serve.canary import CanaryRouter

log = logging.getLogger("mcp2026.serve")


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, async_engine: AsyncEngine, serve_config: ServeConfig) -> None:
        super().__init__(config)
        self.async_engine = async_engine
        self.serve_config = serve_config
        self._loop: asyncio.AbstractEventLoop | None = None
        self._is_shutting_down = False

    async def serve(self, sockets: list | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._is_shutting_down or self._loop is None:
            super().handle_exit(sig, frame)  # a second signal: stop now
            return
        self._is_shutting_down = True
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self.shutdown_gracefully(sig)))

    async def shutdown_gracefully(self, sig: int = signal.SIGTERM) -> None:
        drain = self.serve_config.drain_on_sigterm
        log.info(
            "%s: %s %d in-flight requests",
            signal.Signals(sig).name,
            "draining" if drain else "aborting",
            self.async_engine.num_in_flight,
        )
        self.config.app.state.service.is_draining = True
        timeout_s = self.serve_config.drain_timeout_s
        canary = getattr(self.config.app.state, "canary", None)  # the candidate's engine drains alike
        await asyncio.gather(
            self.async_engine.shutdown(drain=drain, timeout_s=timeout_s),
            *([canary.shutdown(drain=drain, timeout_s=timeout_s)] if canary is not None else []),
        )
        self.should_exit = True


def build_pipeline(serve_config: ServeConfig, engine_config: EngineConfig) -> Pipeline:
    """The model ``serve_config`` names, quantized as its ``quant`` YAML asks (its calibration and dqg
    sections included: the plan ``mcp2026 compile`` of that YAML would choose), on an engine with
    ``engine_config``'s KV cache, KV compressor, scheduler and speculative decoding: what a server with these
    configs runs."""
    return Pipeline(
        model=serve_config.model,
        config=load_quant_spec(serve_config.quant) if serve_config.quant else None,
        dtype=serve_config.dtype,
        device=serve_config.device,
        kv=engine_config.kv_compressor,
        scheduler=engine_config.scheduler,
        kv_config=engine_config.kv,
        speculative=engine_config.speculative,
    )


def load_pipeline(serve_config: ServeConfig, engine_config: EngineConfig) -> tuple[Pipeline, ComputeThread]:
    """``build_pipeline`` on a new ComputeThread, returned with it: the engine's steps must run on the thread
    that loaded the model (compute_thread.py says why), so pass it to ``AsyncEngine(compute_thread=...)``."""
    compute = ComputeThread()
    return compute.run(build_pipeline, serve_config, engine_config), compute


def build_server(
    serve_config: ServeConfig, engine_config: EngineConfig, log_level: str = "info"
) -> GracefulServer:
    """Load the model ``serve_config`` names (quantized as its ``quant`` YAML asks, KV compressed as
    ``engine_config.kv_compressor`` asks) and wrap it in a server; with ``canary.candidate`` also the
    candidate configuration, which serves ``canary.candidate_share`` of the tenants."""
    tracing = None
    if serve_config.otlp_traces_endpoint is not None:  # a missing SDK fails before any model loads
        tracing = Tracing.from_endpoint(serve_config.otlp_traces_endpoint)
    candidate = None
    if serve_config.canary.candidate is not None:
        candidate = read_candidate(serve_config.canary)  # a bad candidate YAML fails before any model loads
    pipe, compute = load_pipeline(serve_config, engine_config)
    if serve_config.model_name is None:
        serve_config = dataclasses.replace(serve_config, model_name=pipe.loaded.source.stem)
    async_engine = AsyncEngine(pipe.engine, warmup=serve_config.warmup, compute_thread=compute)
    gate = pick_gate(serve_config.traffic.gate, pipe, serve_config.traffic.pressure_kv_sparsity)
    canary = (
        None
        if candidate is None
        else build_router(serve_config, pipe, async_engine, load_pipeline, candidate)
    )
    return make_server(async_engine, pipe.tokenizer, serve_config, log_level, gate, canary, tracing)


def pick_gate(mode: str, pipe: object, pressure_kv_sparsity: float) -> Gate | None:
    """What pressure mode switches: the model's QuantGate ("quant"), the KV eviction budget ("kv"),
    nothing but metrics ("observe"); "auto" takes the first available; "off": no pressure rule."""
    quant_gate = getattr(pipe, "gate", None)  # a QuantGate when the pipeline holds two plans
    evictor = getattr(getattr(pipe, "engine", None), "evictor", None)
    if mode == "quant" and quant_gate is None:
        raise ValueError(
            "traffic gate 'quant' needs a pressure plan: set pressure_bits_budget (with enable_dqg) in the --quant YAML"
        )
    if mode == "kv" and evictor is None:
        raise ValueError("traffic gate 'kv' needs KV eviction: pass --kv-policy (and --kv-sparsity)")
    if mode in ("quant", "auto") and quant_gate is not None:
        return quant_gate
    if mode in ("kv", "auto") and evictor is not None:
        return KVPolicyGate(evictor, pressure_kv_sparsity)
    return None if mode == "off" else ObserveGate()


def make_server(
    async_engine: AsyncEngine,
    tokenizer: object,
    serve_config: ServeConfig,
    log_level: str = "info",
    gate: Gate | None = None,
    canary: CanaryRouter | None = None,
    tracing: Tracing | None = None,
) -> GracefulServer:
    app = create_app(async_engine, tokenizer, serve_config, gate=gate, canary=canary, tracing=tracing)
    config = uvicorn.Config(
        app,
        host=serve_config.host,
        port=serve_config.port,
        ssl_certfile=serve_config.ssl_certfile,
        ssl_keyfile=serve_config.ssl_keyfile,
        log_level=log_level,
        timeout_graceful_shutdown=serve_config.drain_timeout_s,
    )
    return GracefulServer(config, async_engine, serve_config)
