"""One engine replica for Ray Serve: the model, its engine and the OpenAI app, exactly as ``mcp2026 serve``
builds them from a serve YAML, answering HTTP requests the routing ingress forwards through a Ray handle.

No Ray import here: Ray Serve wraps this class (ray_ingress.build_app); the replica only runs the app in
process (ASGI) and reports its load and prefix-cache counters to whoever asks.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from mcp2026.engine.async_engine import AsyncEngine
from mcp2026.serve.app import create_app
from mcp2026.serve.config import load_serve_yaml
from mcp2026.serve.server import load_pipeline


class ForwardedRequest(NamedTuple):
    """An HTTP request as the ingress received it."""

    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    client: tuple[str, int] | None = None


class ResponseHead(NamedTuple):
    status: int
    headers: list[tuple[bytes, bytes]]


@dataclass(frozen=True)
class ReplicaReport:
    """What the router and the autoscaler read. ``incarnation`` changes when the replica restarts (its prefix
    cache is then empty). Counters are totals since the replica started."""

    incarnation: str
    num_waiting: int  # requests added to the engine without a first token yet
    num_running: int
    kv_usage: float  # share of KV blocks in use
    num_prefix_query_blocks: int  # full prompt blocks looked up in the prefix cache
    num_prefix_hit_blocks: int  # found there
    num_cached_tokens: int


class EngineReplica:
    """``config_path``: a serve YAML (the same file ``mcp2026 serve --config`` reads); every replica reads the
    same one, so the model, tenants, quotas and engine settings agree across replicas."""

    def __init__(self, config_path: str) -> None:
        serve_config, engine_config = load_serve_yaml(config_path)
        pipe, compute = load_pipeline(serve_config, engine_config)
        if serve_config.model_name is None:
            serve_config = replace(serve_config, model_name=pipe.loaded.source.stem)
        self.async_engine = AsyncEngine(pipe.engine, warmup=serve_config.warmup, compute_thread=compute)
        self.app = create_app(self.async_engine, pipe.tokenizer, serve_config)
        self.incarnation = uuid.uuid4().hex
        self._lifespan: _Lifespan | None = None
        self._start_lock = asyncio.Lock()

    async def handle_http(self, request: ForwardedRequest) -> AsyncIterator[ResponseHead | bytes]:
        """The app's answer: first a ResponseHead, then body chunks as the app sends them (SSE included).
        Closing the generator early (the client left) tells the app the client disconnected, which aborts
        the engine requests."""
        await self._ensure_started()
        messages: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        disconnected = asyncio.Event()
        is_body_sent = False

        async def receive() -> dict[str, Any]:
            nonlocal is_body_sent
            if not is_body_sent:
                is_body_sent = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            await disconnected.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            await messages.put(message)

        async def run() -> None:
            try:
                await self.app(_scope(request), receive, send)
            finally:
                await messages.put(None)

        task = asyncio.create_task(run())
        try:
            while (message := await messages.get()) is not None:
                if message["type"] == "http.response.start":
                    yield ResponseHead(message["status"], list(message.get("headers", [])))
                elif message["type"] == "http.response.body" and message.get("body"):
                    yield bytes(message["body"])
        finally:
            disconnected.set()
            if not task.done():
                with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                    await asyncio.wait_for(asyncio.shield(task), timeout=5.0)
                task.cancel()

    def report(self) -> ReplicaReport:
        engine = self.async_engine
        stats = engine.stats
        num_waiting = engine.num_queued_requests
        return ReplicaReport(
            incarnation=self.incarnation,
            num_waiting=num_waiting,
            num_running=max(0, engine.num_in_flight - num_waiting),
            kv_usage=float(stats.kv_usage),
            num_prefix_query_blocks=stats.num_prefix_query_blocks,
            num_prefix_hit_blocks=stats.num_prefix_hit_blocks,
            num_cached_tokens=stats.num_cached_tokens,
        )

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Ray Serve's custom autoscaling metrics hook: the load signals ray_autoscaling's policy reads."""
        report = self.report()
        return {"num_waiting": float(report.num_waiting), "kv_usage": report.kv_usage}

    def check_health(self) -> None:
        """Ray Serve's health check: a dead engine loop fails it, so Ray replaces the replica."""
        if self.async_engine.dead_error is not None:
            raise RuntimeError(f"the engine failed: {self.async_engine.dead_error}")

    async def ready(self, timeout_s: float = 120.0) -> bool:
        """Started and warmed up (the first request through the engine) within ``timeout_s``."""
        await self._ensure_started()
        return await self.async_engine.wait_ready(timeout_s)

    async def _ensure_started(self) -> None:
        # The engine loop must start on the event loop that consumes its streams: Ray's, known only here.
        async with self._start_lock:
            if self._lifespan is None:
                self._lifespan = _Lifespan(self.app)
                await self._lifespan.startup()

    async def __del__(self) -> None:
        """Ray Serve's shutdown hook (awaited, after in-flight requests finished or timed out): stop the
        engine loop through the app's lifespan."""
        if self._lifespan is not None:
            await self._lifespan.shutdown()


class _Lifespan:
    """The app's ASGI lifespan (engine start, pressure ticker), run in a task the replica owns."""

    def __init__(self, app: Any) -> None:
        self._app = app
        self._started = asyncio.Event()
        self._stop = asyncio.Event()
        self._failure: str | None = None
        self._task: asyncio.Task[None] | None = None

    async def startup(self) -> None:
        is_startup_sent = False

        async def receive() -> dict[str, Any]:
            nonlocal is_startup_sent
            if not is_startup_sent:
                is_startup_sent = True
                return {"type": "lifespan.startup"}
            await self._stop.wait()
            return {"type": "lifespan.shutdown"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "lifespan.startup.failed":
                self._failure = message.get("message", "startup failed")
            if message["type"].startswith("lifespan.startup"):
                self._started.set()

        self._task = asyncio.create_task(
            self._app({"type": "lifespan", "asgi": {"version": "3.0"}}, receive, send)
        )
        await self._started.wait()
        if self._failure is not None:
            raise RuntimeError(f"the replica's app did not start: {self._failure}")

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        if self._task is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._task, timeout_s)


def _scope(request: ForwardedRequest) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": "http",
        "path": request.path,
        "raw_path": request.path.encode(),
        "root_path": "",
        "query_string": request.query_string,
        "headers": request.headers,
        "client": request.client,
        "server": None,
        "state": {},
    }
