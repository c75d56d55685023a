"""Several engine replicas behind one prefix-aware ingress, on Ray Serve.

``build_app({"config": "serve.yaml", "replicas": 2})`` (also ``serve run mcp2026.serve.ray_ingress:build_app
config=serve.yaml replicas=2``) deploys ``engine-0`` .. ``engine-{N-1}``, each an EngineReplica of the serve
YAML, and ``router``, the HTTP ingress. The router tokenizes each /v1/completions and /v1/chat/completions
prompt as the replicas do, salts it with the caller's tenant, asks PrefixRouter for a replica given every
replica's load (read through its handle), and forwards the request, streamed or not, to that replica's app.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from mcp2026.loading.loader import default_model_path
from mcp2026.loading.tokenizer import Tokenizer
from mcp2026.serve.config import load_serve_yaml
from mcp2026.serve.errors import APIError
from mcp2026.serve.protocol import ChatCompletionRequest, CompletionRequest
from mcp2026.serve.ray_replica import EngineReplica, ForwardedRequest, ReplicaReport, ResponseHead
from mcp2026.serve.replica_router import PrefixRouter, ReplicaLoad, RouterConfig
from mcp2026.serve.routes_openai import api_key_of
from mcp2026.serve.tenants import TenantRegistry

ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions")
REPORT_TIMEOUT_S = 2.0  # a replica that cannot say its load in this time is treated as saturated
UNREACHABLE = ReplicaLoad(num_waiting=10**6, kv_usage=1.0)
# NOTE: Ray's own per-replica cap (5 by default) would queue requests before the engine's scheduler, which
# orders them by tenant weight and priority, sees them; the engine's max_queued_requests answers 429 instead.
MAX_ONGOING_REQUESTS = 1024
HOP_HEADERS = {b"content-length", b"transfer-encoding", b"connection"}


class RoutingIngress:
    """The HTTP entry: every request goes to one replica's app; generation requests by PrefixRouter,
    the rest (models, tokenize, health) to the least-loaded replica."""

    def __init__(self, replicas: list[DeploymentHandle], config_path: str) -> None:
        serve_config, engine_config = load_serve_yaml(config_path)
        self.replicas = {f"engine-{i}": handle for i, handle in enumerate(replicas)}
        self.router = PrefixRouter(list(self.replicas), RouterConfig(block_size=engine_config.kv.block_size))
        self.tenants = (
            TenantRegistry.from_yaml(serve_config.tenants_file)
            if serve_config.tenants_file
            else TenantRegistry()
        )
        model = Path(serve_config.model) if serve_config.model else default_model_path()
        self.tokenizer = Tokenizer.from_hf_dir(model) if model.is_dir() else Tokenizer.from_gguf(model)
        self.max_body_bytes = serve_config.max_request_body_bytes
        self.incarnations: dict[str, str] = {}
        self.route_counts: Counter[tuple[str, str]] = Counter()  # (replica, reason) -> requests

    async def __call__(self, request: Request) -> Response:
        data = bytearray()
        async for chunk in request.stream():  # the replicas' body limit, before the router buffers more
            data += chunk
            if len(data) > self.max_body_bytes:
                message = f"the request body is larger than {self.max_body_bytes} bytes"
                return APIError(413, message, code="request_too_large").response()
        body = bytes(data)
        token_ids: list[int] = []
        salt = ""
        if request.method == "POST" and request.url.path in ROUTED_PATHS:
            token_ids, salt = self._routing_key(request, body)
        loads = await self._loads()
        route = self.router.route(token_ids, loads, salt)
        self.route_counts[(route.replica_id, route.reason)] += 1
        forwarded = ForwardedRequest(
            request.method,
            request.url.path,
            request.url.query.encode(),
            [(k.encode("latin-1"), v.encode("latin-1")) for k, v in request.headers.items()],
            body,
            (request.client.host, request.client.port) if request.client else None,
        )
        stream = self.replicas[route.replica_id].options(stream=True).handle_http.remote(forwarded)
        try:
            head: ResponseHead = await stream.__anext__()
        except Exception as e:  # noqa: BLE001 - a replica that died or restarted mid-call: the client retries
            self.router.forget(route.replica_id)
            message = f"replica {route.replica_id} is unavailable ({type(e).__name__}); retry the request"
            return APIError(503, message, code="replica_unavailable", retry_after_s=1).response()
        headers = {
            k.decode("latin-1"): v.decode("latin-1") for k, v in head.headers if k.lower() not in HOP_HEADERS
        }
        headers["x-mcp2026-replica"] = route.replica_id

        async def chunks() -> Any:
            try:
                async for chunk in stream:
                    yield chunk
            finally:
                stream.cancel()  # the client left: the replica's app sees a disconnect and aborts

        return StreamingResponse(chunks(), status_code=head.status, headers=headers)

    def _routing_key(self, request: Request, body: bytes) -> tuple[list[int], str]:
        """The prompt's token ids as the replica will see them, and the tenant's cache salt. A request the
        replica will refuse (bad JSON, bad key) routes as an empty prompt: it is balanced, then refused there."""
        tenant = self.tenants.authenticate(api_key_of(request))
        try:
            raw = json.loads(body)
            if request.url.path == "/v1/chat/completions":
                chat = ChatCompletionRequest.model_validate(raw)
                messages = [m.as_template_message() for m in chat.messages]
                ids = self.tokenizer.encode_chat(messages, add_generation_prompt=chat.add_generation_prompt)
            else:
                prompt = CompletionRequest.model_validate(raw).prompts()[0]
                ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            request_salt = raw.get("cache_salt")
        except Exception:  # noqa: BLE001 - the replica answers the same request with the precise 4xx
            return [], ""
        tenant_salt = (tenant.cache_salt or "") if tenant is not None else ""
        return ids, tenant_salt if request_salt is None else f"{tenant_salt}\x1f{request_salt}"

    async def _loads(self) -> dict[str, ReplicaLoad]:
        names = list(self.replicas)
        calls = [self.replicas[n].report.remote() for n in names]
        results = await asyncio.gather(
            *(asyncio.wait_for(_awaited(c), REPORT_TIMEOUT_S) for c in calls), return_exceptions=True
        )
        loads = {}
        for name, result in zip(names, results, strict=True):
            if not isinstance(result, ReplicaReport):
                loads[name] = UNREACHABLE
                continue
            if self.incarnations.setdefault(name, result.incarnation) != result.incarnation:
                self.router.forget(name)  # restarted: its prefix cache is empty
                self.incarnations[name] = result.incarnation
            loads[name] = ReplicaLoad(result.num_waiting, result.num_running, result.kv_usage)
        return loads

    async def routes(self) -> dict[str, int]:
        """Requests routed so far, by ``replica/reason``."""
        return {f"{replica}/{reason}": n for (replica, reason), n in sorted(self.route_counts.items())}

    async def ready(self, timeout_s: float = 300.0) -> bool:
        """Every replica started and warmed up within ``timeout_s``."""
        calls = [handle.ready.remote(timeout_s) for handle in self.replicas.values()]
        return all(await asyncio.gather(*(_awaited(c) for c in calls)))

    async def reports(self) -> dict[str, ReplicaReport]:
        """Every replica's report (load and prefix-cache counters)."""
        names = list(self.replicas)
        results = await asyncio.gather(*(self.replicas[n].report.remote() for n in names))
        return dict(zip(names, results, strict=True))


async def _awaited(response: Any) -> Any:
    return await response


def build_app(args: dict[str, Any]) -> serve.Application:
    """The Ray Serve application: ``config`` (a serve YAML, required), ``replicas`` (engine deployments,
    default 2), ``replica_options`` / ``router_options`` (Ray deployment options, e.g. ``ray_actor_options``
    or an ``autoscaling_config``, applied to every engine deployment / the router)."""
    config = args.get("config")
    if not config or not Path(config).is_file():
        raise ValueError(f"build_app needs config=<serve YAML path>; got {config!r}, which is not a file")
    config = str(Path(config).resolve())
    num_replicas = int(args.get("replicas", 2))
    if num_replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {num_replicas}")
    load_serve_yaml(config)  # a bad YAML fails here, before any replica starts
    replica = serve.deployment(
        EngineReplica, **_replica_defaults(), **dict(args.get("replica_options") or {})
    )
    handles = [replica.options(name=f"engine-{i}").bind(config) for i in range(num_replicas)]
    router_options = {
        "max_ongoing_requests": MAX_ONGOING_REQUESTS,
        # NOTE: the router waits on handles and tokenizes; asking a whole CPU for it would leave N engines
        # of one CPU each unschedulable on an N-CPU node.
        "ray_actor_options": {"num_cpus": 0},
        **dict(args.get("router_options") or {}),
    }
    router = serve.deployment(RoutingIngress, name="router", **router_options)
    return router.bind(handles, config)


def _replica_defaults() -> dict[str, Any]:
    return {"max_ongoing_requests": MAX_ONGOING_REQUESTS, "health_check_period_s": 10.0}
