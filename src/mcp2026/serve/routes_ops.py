"""Operational routes: /healthz (engine loop alive), /readyz (warm and accepting), /metrics (Prometheus) and
/canary (the live canary's verdict, when one runs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from mcp2026.engine.async_engine import AsyncEngine
from mcp2026.serve.errors import APIError, error_body
from mcp2026.serve.generation import GenerationService
from mcp2026.serve.metrics import ServerMetrics

if TYPE_CHECKING:
    from mcp2026.canary.live import CanaryRouter


def add_ops_routes(
    app: FastAPI,
    async_engine: AsyncEngine,
    service: GenerationService,
    metrics: ServerMetrics,
    canary: CanaryRouter | None,
) -> None:
    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        if not async_engine.is_alive:
            reason = async_engine.dead_error or "the engine loop is not running"
            return JSONResponse(error_body(503, reason, code="engine_dead"), status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        try:
            service.check_ready()
        except APIError as e:
            return e.response()
        return JSONResponse({"status": "ready"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/canary")
    async def canary_status() -> JSONResponse:
        if canary is None:
            raise APIError(404, "no canary runs here (serve with --canary-config B.yaml)", code="no_canary")
        return JSONResponse(canary.status())
