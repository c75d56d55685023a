"""The OpenAI-compatible HTTP server: ``create_app(async_engine, tokenizer, config)`` builds a FastAPI app.

Routes: POST /v1/completions, POST /v1/chat/completions (both stream as SSE ending in ``data: [DONE]``),
GET /v1/models, /healthz (engine loop alive), /readyz (warm and accepting), /metrics (Prometheus),
/canary (the live canary's verdict, when one runs).
A client that goes away mid-request (stream or not) aborts its engine requests, freeing their KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextvars import ContextVar
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mcp2026.engine.async_engine import AsyncEngine, EngineDeadError
from mcp2026.engine.output_processor import RequestOutput
from mcp2026.serve.config import ServeConfig
from mcp2026.serve.errors import APIError, error_body, install_error_handlers
from mcp2026.serve.generation import Choice, GenerationService, Job
from mcp2026.serve.metrics import ServerMetrics
from mcp2026.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from mcp2026.serve.tenants import Tenant, TenantRegistry
from mcp2026.serve.traffic import Gate, ObserveGate, PressureController

if TYPE_CHECKING:
    from mcp2026.serve.canary import CanaryRouter

log = logging.getLogger("mcp2026.serve")
REQUEST_ID: ContextVar[str] = ContextVar("request_id", default="-")
_REQUEST_ID_OK = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 404, 429, 500, 503)
}


class RequestIdMiddleware:
    """Accept a sane ``X-Request-Id`` or make one; echo it, log each request with it, and answer an
    unexpected exception with a 500 in OpenAI's shape (the id included)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        request_id = given if _REQUEST_ID_OK.match(given) else uuid.uuid4().hex
        token = REQUEST_ID.set(request_id)
        status = [0]
        t0 = time.perf_counter()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                MutableHeaders(scope=message).append("X-Request-Id", request_id)
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            log.exception("request %s %s %s failed", request_id, scope["method"], scope["path"])
            if status[0]:
                raise
            body = json.dumps(error_body(500, "internal server error", code="internal_error")).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            await send_with_id({"type": "http.response.start", "status": 500, "headers": headers})
            await send({"type": "http.response.body", "body": body})
        finally:
            ms = (time.perf_counter() - t0) * 1e3
            log.info(
                "request %s %s %s -> %d (%.0f ms)", request_id, scope["method"], scope["path"], status[0], ms
            )
            REQUEST_ID.reset(token)


async def _until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Run ``work`` unless the client disconnects first; then cancel it (its engine requests abort)."""
    task = asyncio.ensure_future(work)

    async def wait_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        log.info("request %s: client disconnected, aborted", REQUEST_ID.get())
        return Response(status_code=499)
    return task.result()


def _sse(payload: Any) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


def _choice_error(exc: BaseException) -> APIError:
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), code="engine_dead")
    return APIError(500, f"generation failed: {exc}", code="engine_error")


def create_app(
    async_engine: AsyncEngine,
    tokenizer: Any,
    config: ServeConfig | None = None,
    tenants: TenantRegistry | None = None,
    gate: Gate | None = None,
    canary: CanaryRouter | None = None,
) -> FastAPI:
    """``gate``: what pressure mode switches (a QuantGate, a KVPolicyGate); None observes only. The
    traffic config's ``gate: off`` disables the pressure rule. ``canary``: a second engine serving a sticky
    share of the tenants (mcp2026.serve.canary); None serves everything from ``async_engine``."""
    config = config or ServeConfig()
    if tenants is None:
        tenants = TenantRegistry.from_yaml(config.tenants_file) if config.tenants_file else TenantRegistry()
    model_name = config.model_name or (Path(config.model).stem if config.model else "default")
    metrics = ServerMetrics(model_name, lambda: async_engine.stats)
    metrics.watch_engine_time(lambda: async_engine.engine.stats)
    service = GenerationService(async_engine, tokenizer, config, tenants, metrics, model_name)
    async_engine.set_tenant_weights({t.name: t.weight for t in tenants.tenants.values()})
    metrics.watch_traffic(service.traffic.snapshot)
    if canary is not None:
        canary.attach(metrics)
        canary.candidate.engine.set_tenant_weights({t.name: t.weight for t in tenants.tenants.values()})
    if config.traffic.gate != "off":
        gate = gate or ObserveGate()
        log.info("pressure gate: %s", getattr(gate, "name", type(gate).__name__))
        service.pressure = PressureController(
            service.traffic,
            gate,
            run=async_engine.run_between_steps,
            on_switch=lambda plan, _snap: metrics.observe_gate_switch(plan),
        )

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

    app = FastAPI(title="mcp2026", version="0.1.0", lifespan=lifespan)
    app.state.service = service
    app.state.metrics = metrics
    app.state.canary = canary
    install_error_handlers(app)
    if config.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.cors_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["*"],
            expose_headers=["X-Request-Id"],
        )
    app.add_middleware(RequestIdMiddleware)

    def api_key_of(request: Request) -> str | None:
        auth = request.headers.get("authorization", "")
        return auth[7:].strip() if auth[:7].lower() == "bearer " else request.headers.get("x-api-key")

    def tenant_of(request: Request) -> Tenant:
        tenant = tenants.authenticate(api_key_of(request))
        if tenant is None:
            metrics.observe_rejected("unknown", 401)
            raise APIError(
                401, "invalid or missing API key (send Authorization: Bearer KEY)", code="invalid_api_key"
            )
        return tenant

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

    def route_to_arm(job: Job, request: Request, tenant: Tenant) -> None:
        if canary is not None:
            host = request.client.host if request.client else None
            job.arm = canary.route(canary.sticky_key(tenant, api_key_of(request), host, tenants.is_open))

    @app.get("/v1/models", response_model=ModelList, responses=ERROR_RESPONSES)
    async def models(tenant: Tenant = Depends(tenant_of)) -> ModelList:
        return ModelList(data=[ModelCard(id=model_name, max_model_len=service.max_model_len)])

    @app.post("/v1/completions", responses=ERROR_RESPONSES)
    async def completions(
        body: CompletionRequest, request: Request, tenant: Tenant = Depends(tenant_of)
    ) -> Any:
        service.check_model(body.model)
        service.check_ready()
        prompts, texts = service.completion_prompts(body)
        job = service.make_job("completion", body, prompts, body.max_tokens, body.logprobs, tenant)
        job.echo_texts = texts if body.echo else None
        route_to_arm(job, request, tenant)
        log.info(
            "request %s: %s, %d choices, tenant %s", REQUEST_ID.get(), job.id, len(job.choices), tenant.name
        )
        if body.stream:
            return _stream(service, job, _completion_chunk, body.include_usage)
        try:
            return await _until_disconnect(request, _complete(service, job, _completion_body))
        finally:
            service.release(job)

    @app.post("/v1/chat/completions", responses=ERROR_RESPONSES)
    async def chat_completions(
        body: ChatCompletionRequest, request: Request, tenant: Tenant = Depends(tenant_of)
    ) -> Any:
        service.check_model(body.model)
        service.check_ready()
        prompt = service.chat_prompt(body)
        job = service.make_job("chat", body, [prompt], body.requested_max_tokens, body.num_logprobs, tenant)
        route_to_arm(job, request, tenant)
        log.info(
            "request %s: %s, %d choices, tenant %s", REQUEST_ID.get(), job.id, len(job.choices), tenant.name
        )
        if body.stream:
            return _stream(service, job, _chat_chunk, body.include_usage)
        try:
            return await _until_disconnect(request, _complete(service, job, _chat_body))
        finally:
            service.release(job)

    return app


# ---- non-streaming --------------------------------------------------------------------------------
async def _complete(service: GenerationService, job: Job, render: Any) -> JSONResponse:
    async for choice, item in service.outputs(job):
        if isinstance(item, Exception):
            choice.finish_reason, choice.error = "error", str(item)
            raise _choice_error(item)
    failed = next((c for c in job.choices if c.finish_reason == "error"), None)
    if failed is not None:
        raise APIError(500, f"generation failed: {failed.error}", code="engine_error")
    return JSONResponse(render(service, job))


def _completion_body(service: GenerationService, job: Job) -> dict:
    choices = []
    for c in job.choices:
        prefix = job.echo_texts[c.prompt_index] if job.echo_texts else ""
        logprobs = None
        if job.num_logprobs is not None:
            c.text_offset = len(prefix)
            logprobs = service.completion_logprobs(c, c.logprobs, job.num_logprobs).model_dump()
        choices.append(
            {
                "index": c.index,
                "text": prefix + c.text,
                "logprobs": logprobs,
                "finish_reason": c.finish_reason,
            }
        )
    return _envelope(service, job, "text_completion", choices) | {"usage": job.usage()}


def _chat_body(service: GenerationService, job: Job) -> dict:
    choices = [
        {
            "index": c.index,
            "message": {"role": "assistant", "content": c.text},
            "logprobs": None if job.num_logprobs is None else service.chat_logprobs(c.logprobs).model_dump(),
            "finish_reason": c.finish_reason,
        }
        for c in job.choices
    ]
    return _envelope(service, job, "chat.completion", choices) | {"usage": job.usage()}


def _envelope(service: GenerationService, job: Job, kind: str, choices: list[dict]) -> dict:
    return {
        "id": job.id,
        "object": kind,
        "created": job.created,
        "model": service.model_name,
        "choices": choices,
    }


# ---- streaming ------------------------------------------------------------------------------------
def _stream(
    service: GenerationService, job: Job, render_chunk: Any, include_usage: bool
) -> StreamingResponse:
    async def events() -> AsyncIterator[str]:
        started: set[int] = set()
        try:
            async for choice, item in service.outputs(job):
                if isinstance(item, Exception):
                    choice.finish_reason, choice.error = "error", str(item)
                    yield _sse(_choice_error(item).body())
                    continue
                if item.finish_reason == "error":
                    yield _sse(APIError(500, f"generation failed: {item.error}", code="engine_error").body())
                    continue
                chunk = render_chunk(service, job, choice, item, choice.index not in started)
                started.add(choice.index)
                if chunk is not None:
                    yield _sse(chunk)
            if include_usage:
                usage_chunk = _envelope(service, job, _chunk_kind(job), []) | {"usage": job.usage()}
                yield _sse(usage_chunk)
            yield _sse("[DONE]")
        finally:
            service.release(job)

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    # NOTE: the background task releases the job even when the client left before the first chunk.
    return StreamingResponse(
        events(),
        media_type="text/event-stream",
        headers=headers,
        background=BackgroundTask(service.release, job),
    )


def _chunk_kind(job: Job) -> str:
    return "chat.completion.chunk" if job.kind == "chat" else "text_completion"


def _completion_chunk(
    service: GenerationService, job: Job, choice: Choice, out: RequestOutput, is_first: bool
) -> dict | None:
    text = out.delta_text
    if is_first and job.echo_texts:
        text = job.echo_texts[choice.prompt_index] + text
        choice.text_offset = len(job.echo_texts[choice.prompt_index])
    if not text and not out.finished and not out.delta_logprobs:
        return None
    logprobs = None
    if job.num_logprobs is not None and out.delta_logprobs:
        logprobs = service.completion_logprobs(choice, out.delta_logprobs, job.num_logprobs).model_dump()
    c = {"index": choice.index, "text": text, "logprobs": logprobs, "finish_reason": out.finish_reason}
    return _envelope(service, job, "text_completion", [c])


def _chat_chunk(
    service: GenerationService, job: Job, choice: Choice, out: RequestOutput, is_first: bool
) -> dict | None:
    if not out.delta_text and not out.finished and not out.delta_logprobs and not is_first:
        return None
    delta: dict[str, Any] = {"content": out.delta_text}
    if is_first:
        delta["role"] = "assistant"
    logprobs = None
    if job.num_logprobs is not None and out.delta_logprobs:
        logprobs = service.chat_logprobs(out.delta_logprobs).model_dump()
    c = {"index": choice.index, "delta": delta, "logprobs": logprobs, "finish_reason": out.finish_reason}
    return _envelope(service, job, "chat.completion.chunk", [c])
