"""POST /v1/embeddings: one vector per input from the served model's final hidden states, behind the tenant's
API key and token quota. Always the primary engine (a live canary splits generation traffic only).
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
from fastapi import Depends, FastAPI, Request

from mcp2026.engine.async_engine import EngineDeadError, EngineNotReadyError
from mcp2026.serve.errors import APIError
from mcp2026.serve.generation import GenerationService
from mcp2026.serve.metrics import ServerMetrics
from mcp2026.serve.protocol_embeddings import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from mcp2026.serve.responses import until_disconnect
from mcp2026.serve.routes_openai import ERROR_RESPONSES, tenant_dependency
from mcp2026.serve.tenants import RateLimitExceeded, Tenant, TenantRegistry
from mcp2026.types import EmbeddingParams


def encode_vector(vector: list[float], encoding_format: str) -> list[float] | str:
    """A vector as JSON floats, or as OpenAI's base64: the little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


def request_token_ids(service: GenerationService, body: EmbeddingRequest) -> list[list[int]]:
    """Each input's token ids, checked: a 400 naming ``input`` for too many inputs or a bad one."""
    inputs = body.inputs()
    cap = service.config.max_embedding_inputs
    if len(inputs) > cap:
        raise APIError(
            400, f"input holds {len(inputs)} inputs; this server takes at most {cap}", param="input"
        )
    embedder = service.engine.engine.embedder
    token_lists = []
    for i, item in enumerate(inputs):
        ids = service.need_tokenizer("input").encode(item) if isinstance(item, str) else item
        if len(ids) > service.max_model_len:
            raise APIError(
                400,
                f"input[{i}] has {len(ids)} tokens but this model's maximum context length is "
                f"{service.max_model_len} tokens; shorten it",
                param="input",
                code="context_length_exceeded",
            )
        try:
            token_lists.append(embedder.token_ids(ids, i, "input"))
        except ValueError as e:
            raise APIError(400, str(e), param="input") from None
    return token_lists


def embedding_params(service: GenerationService, body: EmbeddingRequest) -> EmbeddingParams:
    hidden = service.engine.engine.embedder.hidden_size
    if body.dimensions is not None and body.dimensions > hidden:
        raise APIError(
            400,
            f"dimensions is {body.dimensions} but this model's embeddings have {hidden}; ask for at most {hidden}",
            param="dimensions",
        )
    pooling = body.pooling or service.config.embedding_pooling
    return EmbeddingParams(pooling, body.normalize, body.dimensions)


def add_embedding_routes(
    app: FastAPI, service: GenerationService, tenants: TenantRegistry, metrics: ServerMetrics
) -> None:
    tenant_of = tenant_dependency(tenants, metrics)

    @app.post("/v1/embeddings", response_model=EmbeddingResponse, responses=ERROR_RESPONSES)
    async def embeddings(
        body: EmbeddingRequest, request: Request, tenant: Tenant = Depends(tenant_of)
    ) -> Any:
        service.check_model(body.model)
        service.check_ready()
        params = embedding_params(service, body)
        token_lists = request_token_ids(service, body)
        num_tokens = sum(len(t) for t in token_lists)
        try:
            tenants.acquire(tenant, num_tokens)
        except RateLimitExceeded as e:
            metrics.observe_rejected(tenant.name, 429)
            raise APIError(429, str(e), code="rate_limit_exceeded", retry_after_s=e.retry_after_s) from None
        try:  # a client that leaves cancels the forwards not yet run
            return await until_disconnect(
                request, respond(service, token_lists, params, body.encoding_format)
            )
        finally:
            tenants.release(tenant, num_tokens, num_tokens)


async def respond(
    service: GenerationService, token_lists: list[list[int]], params: EmbeddingParams, encoding_format: str
) -> EmbeddingResponse:
    try:
        result = await service.engine.embed(token_lists, params)
    except ValueError as e:  # the inputs were checked already; the engine checks them again
        raise APIError(400, str(e), param="input") from None
    except EngineDeadError:
        raise APIError(
            503, "the engine failed and is not serving; restart the server", code="engine_dead"
        ) from None
    except EngineNotReadyError:
        raise APIError(
            503, "the server is shutting down; retry later", code="not_ready", retry_after_s=1
        ) from None
    except Exception as e:  # noqa: BLE001 - a failed forward is this request's 500, in OpenAI's shape
        raise APIError(500, f"the embedding forward failed: {type(e).__name__}: {e}") from None
    data = [
        EmbeddingData(index=i, embedding=encode_vector(v, encoding_format))
        for i, v in enumerate(result.embeddings)
    ]
    usage = EmbeddingUsage(prompt_tokens=result.total_tokens, total_tokens=result.total_tokens)
    return EmbeddingResponse(data=data, model=service.model_name, usage=usage)
