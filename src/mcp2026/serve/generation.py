"""From a validated OpenAI request to engine streams and back: tokenize, check, admit, merge the n choices.

One HTTP request is a ``Job``: ``len(prompts) * n`` engine requests ("choices"), admitted together against
the queue caps and the tenant's quota, released together with the tokens they really used.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mcp2026.engine.async_engine import AsyncEngine, RequestTiming
from mcp2026.engine.output_processor import RequestOutput
from mcp2026.engine.structured import GrammarError
from mcp2026.serve.config import ServeConfig
from mcp2026.serve.errors import APIError
from mcp2026.serve.metrics import ServerMetrics
from mcp2026.serve.protocol import (
    ChatCompletionRequest,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    CompletionRequest,
    TopLogprob,
)
from mcp2026.serve.slo import STATE_VALUES, BreakerOpen, CircuitBreaker
from mcp2026.serve.tenants import RateLimitExceeded, Tenant, TenantRegistry
from mcp2026.serve.tools import ToolPlan, template_inputs
from mcp2026.serve.traffic import PressureController, TrafficProfile
from mcp2026.types import SamplingParams, StructuredOutputs, TokenLogprob

if TYPE_CHECKING:
    from mcp2026.serve.tracing import Tracing

log = logging.getLogger("mcp2026.serve")


@dataclass
class Choice:
    """What the server accumulates for one engine request."""

    index: int
    prompt_index: int
    num_prompt_tokens: int
    timing: RequestTiming = field(default_factory=RequestTiming)
    text: str = ""
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # echo with logprobs: one per prompt token
    text_offset: int = 0  # completions logprobs: offset of the next token's text
    finish_reason: str | None = None
    error: str | None = None
    first_token_time: float | None = None
    last_output_time: float | None = None
    detokenize_s: float = 0.0

    def update(self, out: RequestOutput) -> None:
        self.text += out.delta_text
        self.num_output_tokens = len(out.output.token_ids)
        self.num_cached_tokens = out.num_cached_tokens
        self.logprobs += out.delta_logprobs or []
        self.prompt_logprobs = out.output.prompt_logprobs or self.prompt_logprobs
        self.first_token_time = self.first_token_time or out.first_token_time
        self.detokenize_s = out.detokenize_s
        if out.finished:
            self.finish_reason = out.finish_reason
            self.error = out.error
            self.text = out.output.text  # the final text (stop strings cut)


@dataclass
class Job:
    id: str
    kind: str  # "completion" | "chat"
    tenant: Tenant
    prompts: list[list[int]]
    params: list[SamplingParams]  # one per choice; choice i uses prompt i // n
    n: int
    num_logprobs: int | None
    estimated_tokens: int
    echo_texts: list[str] | None = None
    tools: ToolPlan | None = None  # chat with tools: outputs are parsed into tool_calls
    priority: int = 0  # added to the tenant's priority
    ttft_deadline_s: float | None = None
    cache_salt: str | None = (
        None  # the tenant's salt and the request's own: prefix blocks shared only within both
    )
    created: int = field(default_factory=lambda: int(time.time()))
    choices: list[Choice] = field(default_factory=list)
    num_returned: int = 1  # choices returned per prompt (n); ``n`` above is how many are generated
    generated: list[Choice] | None = None  # best_of: every generated choice, after keep_best picked
    is_released: bool = False
    is_probe: bool = False  # admitted as a half-open breaker probe
    arm: Any = None  # live canary: the ArmTraffic (engine, latencies) serving it; None: the one engine

    def keep_best(self) -> None:
        """best_of: keep the ``num_returned`` choices per prompt with the highest mean logprob per token
        (OpenAI's rule), renumbered; usage still counts every generated token."""
        if self.num_returned >= self.n:
            return
        self.generated = self.choices
        kept = []
        for p in range(len(self.prompts)):
            group = [c for c in self.choices if c.prompt_index == p]
            group.sort(key=lambda c: -sum(t.logprob for t in c.logprobs) / max(1, len(c.logprobs)))
            kept += group[: self.num_returned]
        for i, c in enumerate(kept):
            c.index = i
        self.choices = kept

    def usage(self) -> dict[str, Any]:
        generated = self.generated or self.choices
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(c.num_output_tokens for c in generated)
        cached_per_prompt: dict[int, int] = {}  # the prompt's cached tokens, from its first choice
        for c in generated:
            cached_per_prompt.setdefault(c.prompt_index, c.num_cached_tokens)
        cached = sum(cached_per_prompt.values())
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }


class GenerationService:
    def __init__(
        self,
        engine: AsyncEngine,
        tokenizer: Any,
        config: ServeConfig,
        tenants: TenantRegistry,
        metrics: ServerMetrics,
        model_name: str,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.config = config
        self.tenants = tenants
        self.metrics = metrics
        self.model_name = model_name
        self.is_draining = False
        self.breaker = CircuitBreaker(config.breaker, self._on_breaker_change)
        self.traffic = TrafficProfile(config.traffic)
        self.pressure: PressureController | None = None  # set by create_app when a gate is configured
        self.tracing: Tracing | None = None  # set by create_app when tracing is on; None costs nothing
        self._token_text_cache: dict[int, str] = {}

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.max_model_len

    # ---- checks before any work -----------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def check_ready(self) -> None:
        if self.engine.dead_error is not None:
            raise APIError(
                503, "the engine failed and is not serving; restart the server", code="engine_dead"
            )
        if self.is_draining or not self.engine.is_ready:
            state = "shutting down" if self.is_draining else "not ready yet"
            raise APIError(503, f"the server is {state}; retry later", code="not_ready", retry_after_s=1)

    def need_tokenizer(self, param: str = "prompt") -> Any:
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send prompts as token id lists", param=param)
        return self.tokenizer

    def check_prompt(self, ids: list[int], param: str) -> None:
        if not ids:
            raise APIError(400, "the prompt is empty after tokenization", param=param)
        vocab = self.engine.engine.model_config.vocab_size
        if max(ids) >= vocab:
            raise APIError(400, f"prompt token ids must be < the vocabulary size {vocab}", param=param)
        if len(ids) + 1 > self.max_model_len:
            raise APIError(
                400,
                f"the prompt has {len(ids)} tokens but this model's maximum context length is "
                f"{self.max_model_len} tokens (prompt + at least 1 generated token); shorten the prompt",
                param=param,
                code="context_length_exceeded",
            )

    def completion_prompts(self, req: CompletionRequest) -> tuple[list[list[int]], list[str]]:
        prompts, texts = [], []
        for p in req.prompts():
            if isinstance(p, str):
                ids, text = self.need_tokenizer().encode(p), p
            else:
                ids = list(p)
                text = self.tokenizer.decode(ids) if req.echo and self.tokenizer is not None else ""
            self.check_prompt(ids, "prompt")
            prompts.append(ids)
            texts.append(text)
        return prompts, texts

    def chat_prompt(
        self, req: ChatCompletionRequest, plan: ToolPlan | None = None, check: bool = True
    ) -> list[int]:
        tokenizer = self.need_tokenizer()
        messages = [m.as_template_message() for m in req.messages]
        messages, tools = template_inputs(plan, messages, getattr(tokenizer, "chat_template", None))
        try:
            ids = tokenizer.encode_chat(
                messages, add_generation_prompt=req.add_generation_prompt, tools=tools
            )
        except Exception as e:  # noqa: BLE001 - a template that rejects the conversation is the client's 400
            raise APIError(400, f"the chat template rejected these messages: {e}", param="messages") from None
        if check:
            self.check_prompt(ids, "messages")
        return ids

    async def check_structured(self, spec: StructuredOutputs | None, param: str | None) -> None:
        """Compile the constraint before queueing (a cache hit later): what cannot be enforced is a 400."""
        if spec is None:
            return
        self.need_tokenizer()
        try:
            compiler = await asyncio.to_thread(self.engine.engine.grammar_compiler)
            await asyncio.to_thread(compiler.compile, spec)
        except GrammarError as e:
            raise APIError(400, f"{param}: {e}", param=param) from None

    # ---- admission ------------------------------------------------------------------------------
    def make_job(
        self,
        kind: str,
        req: CompletionRequest | ChatCompletionRequest,
        prompts: list[list[int]],
        max_tokens: int | None,
        num_logprobs: int | None,
        tenant: Tenant,
        structured: StructuredOutputs | None = None,
    ) -> Job:
        if req.n > self.config.max_n:
            raise APIError(400, f"n must be <= {self.config.max_n}, got {req.n}", param="n")
        per_prompt = req.num_generated
        if per_prompt > self.config.max_n:
            raise APIError(400, f"best_of must be <= {self.config.max_n}, got {per_prompt}", param="best_of")
        num_requests = len(prompts) * per_prompt
        num_tokens = sum(len(p) for p in prompts) * per_prompt
        if self.engine.num_queued_requests + num_requests > self.config.max_queued_requests:
            raise APIError(429, "the server queue is full; retry later", code="queue_full", retry_after_s=1)
        if self.engine.num_queued_tokens + num_tokens > self.config.max_queued_tokens:
            raise APIError(
                429,
                "the server queue holds too many prompt tokens; retry later",
                code="queue_full",
                retry_after_s=1,
            )
        vocab = self.engine.engine.model_config.vocab_size
        for name in ("stop_token_ids", "logit_bias"):
            ids = [int(t) for t in getattr(req, name) or ()]
            if ids and max(ids) >= vocab:
                raise APIError(400, f"{name} takes token ids < the vocabulary size {vocab}", param=name)
        params = []
        for p in prompts:
            limit = self.max_model_len - len(p)
            for i in range(per_prompt):
                max_new = min(max_tokens or limit, limit)
                # best_of ranks by the sampled tokens' logprobs, which the engine reports when asked
                wanted = 0 if num_logprobs is None and per_prompt > req.n else num_logprobs
                params.append(req.sampling_params(max_new, wanted, i, structured))
        estimated = num_tokens + (max_tokens or 0) * num_requests
        try:
            self.tenants.acquire(tenant, estimated)
        except RateLimitExceeded as e:
            self.metrics.observe_rejected(tenant.name, 429)
            raise APIError(429, str(e), code="rate_limit_exceeded", retry_after_s=e.retry_after_s) from None
        try:
            is_probe = self.breaker.admit(tenant.priority)
        except BreakerOpen as e:
            self.tenants.release(tenant, estimated, 0)
            self.metrics.observe_rejected(tenant.name, 429)
            raise APIError(429, str(e), code="breaker_open", retry_after_s=e.retry_after_s) from None
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        job = Job(
            f"{prefix}-{uuid.uuid4().hex[:24]}",
            kind,
            tenant,
            prompts,
            params,
            per_prompt,
            num_logprobs,
            estimated,
        )
        job.num_returned = req.n
        job.choices = [Choice(i, i // per_prompt, len(prompts[i // per_prompt])) for i in range(num_requests)]
        job.is_probe = is_probe
        job.priority = req.priority
        job.ttft_deadline_s = None if req.ttft_deadline_ms is None else req.ttft_deadline_ms / 1e3
        job.cache_salt = _cache_salt(tenant.cache_salt, req.cache_salt)
        self.traffic.observe_arrival(max(len(p) for p in prompts))
        self.update_pressure()
        return job

    # ---- running --------------------------------------------------------------------------------
    async def outputs(self, job: Job) -> AsyncIterator[tuple[Choice, RequestOutput | Exception]]:
        """Every choice's outputs, interleaved as they come. Engine failures arrive as exceptions.
        Closing this iterator early cancels (aborts) every choice still running."""
        queue: asyncio.Queue = asyncio.Queue()

        engine = self.engine if job.arm is None else job.arm.engine

        async def pump(choice: Choice) -> None:
            try:
                stream = engine.generate(
                    job.prompts[choice.prompt_index],
                    job.params[choice.index],
                    f"{job.id}-{choice.index}",
                    priority=job.tenant.priority + job.priority,
                    cache_salt=job.cache_salt,
                    timing=choice.timing,
                    tenant=job.tenant.name,
                    ttft_deadline_s=job.ttft_deadline_s,
                )
                async for out in stream:
                    queue.put_nowait((choice, out))
            except Exception as e:  # noqa: BLE001 - reported to the client as this choice's error
                queue.put_nowait((choice, e))
            finally:
                queue.put_nowait((choice, None))

        tasks = [asyncio.create_task(pump(c)) for c in job.choices]
        num_done = 0
        try:
            while num_done < len(tasks):
                choice, item = await queue.get()
                if item is None:
                    num_done += 1
                    continue
                if isinstance(item, RequestOutput):
                    self._observe_output(job, choice, item)
                yield choice, item
        finally:
            for task in tasks:
                task.cancel()
            if any(not t.done() for t in tasks):
                await asyncio.gather(*tasks, return_exceptions=True)

    def _observe_output(self, job: Job, choice: Choice, out: RequestOutput) -> None:
        now = time.perf_counter()
        if choice.last_output_time is not None:
            self.metrics.observe_itl(job.tenant.name, now - choice.last_output_time)
        choice.last_output_time = now
        choice.update(out)

    def release(self, job: Job) -> None:
        """Quota and metrics once the job is over, however it ended (idempotent)."""
        if job.is_released:
            return
        job.is_released = True
        generated = job.generated or job.choices
        used = sum(len(p) for p in job.prompts) * job.n + sum(c.num_output_tokens for c in generated)
        self.tenants.release(job.tenant, job.estimated_tokens, used)
        outcome = self._slo_outcome(job)
        if outcome is None:
            if job.is_probe:
                self.breaker.cancel_probe()
        else:
            self.breaker.record(is_bad=outcome, is_probe=job.is_probe)
            ends = [c.last_output_time - c.timing.arrival_time for c in job.choices if c.last_output_time]
            is_error = any(c.finish_reason == "error" for c in job.choices)
            self.traffic.observe_finish(is_error, max(ends, default=None))
            self.update_pressure()
        for c in job.choices:
            arrival = c.timing.arrival_time
            end = c.last_output_time
            ttft_s = None if c.first_token_time is None else c.first_token_time - arrival
            e2e_s = None if end is None or c.finish_reason is None else end - arrival
            self.metrics.observe_finished(
                job.tenant.name,
                c.finish_reason or "abort",
                num_prompt_tokens=c.num_prompt_tokens,
                num_output_tokens=c.num_output_tokens,
                ttft_s=ttft_s,
                e2e_s=e2e_s,
                queue_s=c.timing.queue_time_s,
            )
            if job.arm is not None:
                job.arm.observe(c.finish_reason or "abort", ttft_s, e2e_s)
        if self.tracing is not None:
            self.tracing.record(job, self.model_name)

    def _slo_outcome(self, job: Job) -> bool | None:
        """True if the job failed or missed an SLO, False if it met them, None if it was cut short."""
        if any(c.finish_reason == "error" for c in job.choices):
            return True
        if any(c.finish_reason in (None, "abort") for c in job.choices):
            return None
        ttft_slo, tpot_slo = self.config.slo_ttft_ms / 1e3, self.config.slo_tpot_ms / 1e3
        for c in job.choices:
            if c.first_token_time is None or c.last_output_time is None:
                continue
            if c.first_token_time - c.timing.arrival_time > ttft_slo:
                return True
            decode_s = c.last_output_time - c.first_token_time
            if c.num_output_tokens > 1 and decode_s / (c.num_output_tokens - 1) > tpot_slo:
                return True
        return False

    def update_pressure(self) -> None:
        if self.pressure is not None:
            self.pressure.update()

    def _on_breaker_change(self, state: str) -> None:
        log.warning("SLO circuit breaker is now %s (bad share %.1f%%)", state, 100 * self.breaker.bad_share())
        self.metrics.observe_breaker(state, STATE_VALUES[state])

    # ---- formatting -----------------------------------------------------------------------------
    def token_text(self, token_id: int) -> str:
        text = self._token_text_cache.get(token_id)
        if text is None:
            text = (
                str(token_id)
                if self.tokenizer is None
                else self.tokenizer.decode([token_id], skip_special_tokens=False)
            )
            self._token_text_cache[token_id] = text
        return text

    def completion_logprobs(
        self,
        choice: Choice,
        logprobs: Sequence[TokenLogprob],
        num_top: int,
        prompt_ids: Sequence[int] = (),
        prompt_logprobs: Sequence[TokenLogprob | None] = (),
    ) -> CompletionLogprobs:
        """An echoed prompt's tokens and their logprobs come first (its first token has none: null)."""
        ids = [*prompt_ids, *(lp.token_id for lp in logprobs)]
        entries = [*prompt_logprobs, *logprobs]
        tokens = [self.token_text(t) for t in ids]
        offsets = []
        for t in tokens:
            offsets.append(choice.text_offset)
            choice.text_offset += len(t)
        top = None
        if num_top:
            top = [
                None if lp is None else {self.token_text(i): v for i, v in lp.top.items()} for lp in entries
            ]
        return CompletionLogprobs(
            tokens=tokens,
            token_logprobs=[None if lp is None else lp.logprob for lp in entries],
            top_logprobs=top,
            text_offset=offsets,
        )

    def chat_logprobs(self, logprobs: Sequence[TokenLogprob]) -> ChatLogprobs:
        def entry(token_id: int, value: float) -> TopLogprob:
            text = self.token_text(token_id)
            return TopLogprob(token=text, logprob=value, bytes=list(text.encode("utf-8")))

        content = []
        for lp in logprobs:
            top = [entry(i, v) for i, v in sorted(lp.top.items(), key=lambda kv: -kv[1])]
            head = entry(lp.token_id, lp.logprob)
            content.append(ChatTokenLogprob(**head.model_dump(), top_logprobs=top))
        return ChatLogprobs(content=content)


def _cache_salt(tenant_salt: str | None, request_salt: str | None) -> str | None:
    """A request's ``cache_salt`` narrows its tenant's: it can never reach another tenant's blocks."""
    if request_salt is None:
        return tenant_salt
    return f"{tenant_salt or ''}\x1f{request_salt}"
