"""The OpenAI-compatible routes: GET /v1/models, POST /v1/completions and POST /v1/chat/completions (both stream
as SSE when asked), POST /tokenize and /detokenize, each behind the tenant's API key; with a live canary, a
request goes to the arm its sticky key picks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI, Request

from mcp2026.serve.errors import APIError
from mcp2026.serve.generation import GenerationService, Job
from mcp2026.serve.metrics import ServerMetrics
from mcp2026.serve.middleware import REQUEST_ID, log
from mcp2026.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from mcp2026.serve.responses import (
    chat_body,
    chat_chunk,
    complete,
    completion_body,
    completion_chunk,
    stream,
    until_disconnect,
)
from mcp2026.serve.tenants import Tenant, TenantRegistry
from mcp2026.serve.tools import constraint, plan_tools
from mcp2026.types import StructuredOutputs

if TYPE_CHECKING:
    from mcp2026.canary.live import CanaryRouter

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 429, 500, 503)
}


def api_key_of(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    return auth[7:].strip() if auth[:7].lower() == "bearer " else request.headers.get("x-api-key")


def tenant_dependency(tenants: TenantRegistry, metrics: ServerMetrics) -> Callable[[Request], Tenant]:
    """The routes' dependency that turns the request's API key into its tenant (401 for an unknown key)."""

    def tenant_of(request: Request) -> Tenant:
        tenant = tenants.authenticate(api_key_of(request))
        if tenant is None:
            metrics.observe_rejected("unknown", 401)
            raise APIError(
                401, "invalid or missing API key (send Authorization: Bearer KEY)", code="invalid_api_key"
            )
        return tenant

    return tenant_of


def add_openai_routes(
    app: FastAPI,
    service: GenerationService,
    tenants: TenantRegistry,
    metrics: ServerMetrics,
    canary: CanaryRouter | None,
) -> None:
    tenant_of = tenant_dependency(tenants, metrics)

    def route_to_arm(job: Job, request: Request, tenant: Tenant) -> None:
        if canary is not None:
            host = request.client.host if request.client else None
            job.arm = canary.route(canary.sticky_key(tenant, api_key_of(request), host, tenants.is_open))

    def structured_spec(
        body: CompletionRequest | ChatCompletionRequest,
    ) -> tuple[StructuredOutputs | None, str | None]:
        try:
            return body.structured_spec()
        except ValueError as e:
            raise APIError(400, str(e), param="response_format") from None

    @app.get("/v1/models", response_model=ModelList, responses=ERROR_RESPONSES)
    async def models(tenant: Tenant = Depends(tenant_of)) -> ModelList:
        return ModelList(data=[ModelCard(id=service.model_name, max_model_len=service.max_model_len)])

    async def respond(job, body, request: Request, tenant: Tenant, chunk, whole) -> Any:
        """A job made from either endpoint: routed to its canary arm, then streamed or answered whole."""
        route_to_arm(job, request, tenant)
        log.info(
            "request %s: %s, %d choices, tenant %s", REQUEST_ID.get(), job.id, len(job.choices), tenant.name
        )
        ignored = body.ignored_fields
        if ignored:
            log.warning("request %s: ignored unknown fields %s", REQUEST_ID.get(), ", ".join(ignored))
        if body.stream:
            response = stream(service, job, chunk, body.include_usage)
        else:
            try:
                response = await until_disconnect(request, complete(service, job, whole))
            finally:
                service.release(job)
        if ignored:
            response.headers["X-Ignored-Fields"] = ", ".join(ignored)[:1024]
        return response

    @app.post("/v1/completions", responses=ERROR_RESPONSES)
    async def completions(
        body: CompletionRequest, request: Request, tenant: Tenant = Depends(tenant_of)
    ) -> Any:
        service.check_model(body.model)
        service.check_ready()
        spec, param = structured_spec(body)
        prompts, texts = service.completion_prompts(body)
        await service.check_structured(spec, param)
        job = service.make_job("completion", body, prompts, body.max_tokens, body.logprobs, tenant, spec)
        job.echo_texts = texts if body.echo else None
        return await respond(job, body, request, tenant, completion_chunk, completion_body)

    @app.post("/v1/chat/completions", responses=ERROR_RESPONSES)
    async def chat_completions(
        body: ChatCompletionRequest, request: Request, tenant: Tenant = Depends(tenant_of)
    ) -> Any:
        service.check_model(body.model)
        service.check_ready()
        spec, param = structured_spec(body)
        plan = plan_tools(body)
        if constraint(plan) is not None:
            if spec is not None:
                raise APIError(
                    400, f"{param} cannot be combined with tool_choice required or named", param=param
                )
            spec, param = constraint(plan), "tools"
            if body.ignore_eos or body.min_tokens:
                raise APIError(
                    400,
                    "tool_choice required or named cannot be combined with ignore_eos or min_tokens",
                    param="tool_choice",
                )
        prompt = service.chat_prompt(body, plan)
        await service.check_structured(spec, param)
        job = service.make_job(
            "chat", body, [prompt], body.requested_max_tokens, body.num_logprobs, tenant, spec
        )
        job.tools = plan
        return await respond(job, body, request, tenant, chat_chunk, chat_body)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=ERROR_RESPONSES)
    async def tokenize(body: TokenizeRequest, tenant: Tenant = Depends(tenant_of)) -> TokenizeResponse:
        service.check_model(body.model)
        tokenizer = service.need_tokenizer("prompt")
        if body.messages is not None:
            chat = ChatCompletionRequest.model_construct(  # the messages are validated already
                messages=body.messages, add_generation_prompt=body.add_generation_prompt
            )
            ids = service.chat_prompt(chat, check=False)
        else:
            ids = tokenizer.encode(body.prompt or "", add_special_tokens=body.add_special_tokens)
        return TokenizeResponse(count=len(ids), max_model_len=service.max_model_len, tokens=ids)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=ERROR_RESPONSES)
    async def detokenize(body: DetokenizeRequest, tenant: Tenant = Depends(tenant_of)) -> DetokenizeResponse:
        service.check_model(body.model)
        tokenizer = service.need_tokenizer("tokens")
        vocab = service.engine.engine.model_config.vocab_size
        if body.tokens and max(body.tokens) >= vocab:
            raise APIError(400, f"token ids must be < the vocabulary size {vocab}", param="tokens")
        return DetokenizeResponse(prompt=tokenizer.decode(body.tokens, skip_special_tokens=False))
