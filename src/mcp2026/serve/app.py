"""The OpenAI-compatible HTTP server: ``create_app(async_engine, tokenizer, config)`` builds a FastAPI app.

Routes (routes_openai.py): POST /v1/completions, POST /v1/chat/completions (both stream as SSE ending in
``data: [DONE]``), GET /v1/models; (routes_embeddings.py) POST /v1/embeddings; (routes_ops.py) /healthz
(engine loop alive), /readyz (warm and accepting), /metrics (Prometheus), /canary (the live canary's verdict,
when one runs).
A client that goes away mid-request (stream or not) aborts its engine requests, freeing their KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from mcp2026.engine.async_engine import AsyncEngine
from mcp2026.serve.config import ServeConfig
from mcp2026.serve.errors import install_error_handlers
from mcp2026.serve.generation import GenerationService
from mcp2026.serve.metrics import ServerMetrics
from mcp2026.serve.middleware import BodyLimitMiddleware, RequestIdMiddleware, log
from mcp2026.serve.routes_embeddings import add_embedding_routes
from mcp2026.serve.routes_openai import add_openai_routes
from mcp2026.serve.routes_ops import add_ops_routes
from mcp2026.serve.tenants import TenantRegistry
from mcp2026.serve.tracing import Tracing, TracingMiddleware
from mcp2026.serve.traffic import Gate, ObserveGate, PressureController

if TYPE_CHECKING:
    from mcp2026.serve.canary import CanaryRouter


def create_app(
    async_engine: AsyncEngine,
    tokenizer: Any,
    config: ServeConfig | None = None,
    tenants: TenantRegistry | None = None,
    gate: Gate | None = None,
    canary: CanaryRouter | None = None,
    tracing: Tracing | None = None,
) -> FastAPI:
    """``gate``: what pressure mode switches (a QuantGate, a KVPolicyGate); None observes only. The
    traffic config's ``gate: off`` disables the pressure rule. ``canary``: a second engine serving a sticky
    share of the tenants (mcp2026.serve.canary); None serves everything from ``async_engine``. ``tracing``:
    where request spans go (mcp2026.serve.tracing); None: ``config.otlp_traces_endpoint``'s, or no tracing."""
    config = config or ServeConfig()
    if tenants is None:
        tenants = TenantRegistry.from_yaml(config.tenants_file) if config.tenants_file else TenantRegistry()
    service = _generation_service(async_engine, tokenizer, config, tenants, canary)
    if config.traffic.gate != "off":
        _install_pressure_gate(service, async_engine, gate or ObserveGate())
    app = FastAPI(title="mcp2026", version="0.1.0", lifespan=_lifespan(async_engine, service, config, canary))
    app.state.service = service
    app.state.metrics = service.metrics
    app.state.canary = canary
    install_error_handlers(app)
    if tracing is None and config.otlp_traces_endpoint is not None:
        tracing = Tracing.from_endpoint(config.otlp_traces_endpoint)
    service.tracing = tracing
    _add_middleware(app, config, tracing)
    add_ops_routes(app, async_engine, service, service.metrics, canary)
    add_openai_routes(app, service, tenants, service.metrics, canary)
    add_embedding_routes(app, service, tenants, service.metrics)
    return app


def _generation_service(
    async_engine: AsyncEngine,
    tokenizer: Any,
    config: ServeConfig,
    tenants: TenantRegistry,
    canary: CanaryRouter | None,
) -> GenerationService:
    """The service behind the routes, its metrics watching the engine, the traffic and the canary; tenant
    weights set on every engine that serves them."""
    model_name = config.model_name or (Path(config.model).stem if config.model else "default")
    metrics = ServerMetrics(model_name, lambda: async_engine.stats)
    metrics.watch_engine_time(lambda: async_engine.engine.stats)
    service = GenerationService(async_engine, tokenizer, config, tenants, metrics, model_name)
    weights = {t.name: t.weight for t in tenants.tenants.values()}
    async_engine.set_tenant_weights(weights)
    metrics.watch_traffic(service.traffic.snapshot)
    if canary is not None:
        canary.attach(metrics)
        canary.candidate.engine.set_tenant_weights(weights)
    return service


def _install_pressure_gate(service: GenerationService, async_engine: AsyncEngine, gate: Gate) -> None:
    log.info("pressure gate: %s", getattr(gate, "name", type(gate).__name__))
    service.pressure = PressureController(
        service.traffic,
        gate,
        run=async_engine.run_between_steps,
        on_switch=lambda plan, _snap: service.metrics.observe_gate_switch(plan),
    )


def _lifespan(
    async_engine: AsyncEngine, service: GenerationService, config: ServeConfig, canary: CanaryRouter | None
) -> Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]:
    """Start the engine(s) and the pressure ticker with the app; stop them, without draining, when it stops."""

    async def tick_pressure() -> None:
        # NOTE: without arrivals nothing else re-evaluates the rule; this lets pressure mode end when traffic stops.
        while True:
            await asyncio.sleep(config.traffic.tick_s)
            try:
                service.update_pressure()
            except Exception:  # noqa: BLE001 - the ticker must outlive one bad evaluation
                log.exception("traffic: pressure rule update failed")

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not async_engine.is_started:
            async_engine.start()
        if canary is not None:
            canary.start()
        ticker = asyncio.create_task(tick_pressure()) if service.pressure is not None else None
        yield
        if ticker is not None:
            ticker.cancel()
        await async_engine.shutdown(drain=False)
        if canary is not None:
            await canary.shutdown(drain=False)

    return lifespan


def _add_middleware(app: FastAPI, config: ServeConfig, tracing: Tracing | None) -> None:
    if tracing is not None:
        app.add_middleware(TracingMiddleware, tracing=tracing)
    if config.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.cors_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["*"],
            expose_headers=["X-Request-Id"],
        )
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_request_body_bytes)
    app.add_middleware(RequestIdMiddleware)
