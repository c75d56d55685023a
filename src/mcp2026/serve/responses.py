"""OpenAI response bodies and SSE streams for a generation ``Job``: whole responses (completion and chat), the
streamed chunks of each, the closing usage chunk and ``data: [DONE]``, and the cancellation of a request whose
client disconnects (its engine requests abort, freeing their KV blocks).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from mcp2026.engine.async_engine import EngineDeadError
from mcp2026.engine.output_processor import RequestOutput
from mcp2026.serve.errors import APIError
from mcp2026.serve.generation import Choice, GenerationService, Job
from mcp2026.serve.middleware import REQUEST_ID, log
from mcp2026.serve.tools import parse_tool_calls
from mcp2026.types import TokenLogprob


async def until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
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


# ---- non-streaming --------------------------------------------------------------------------------
async def complete(service: GenerationService, job: Job, render: Any) -> JSONResponse:
    async for choice, item in service.outputs(job):
        if isinstance(item, Exception):
            choice.finish_reason, choice.error = "error", str(item)
            raise _choice_error(item)
    failed = next((c for c in job.choices if c.finish_reason == "error"), None)
    if failed is not None:
        raise APIError(500, f"generation failed: {failed.error}", code="engine_error")
    job.keep_best()
    return JSONResponse(render(service, job))


def completion_body(service: GenerationService, job: Job) -> dict:
    choices = []
    for c in job.choices:
        prefix = job.echo_texts[c.prompt_index] if job.echo_texts else ""
        logprobs = None
        if job.num_logprobs is not None:
            c.text_offset = 0 if job.echo_texts else len(prefix)
            logprobs = service.completion_logprobs(
                c, c.logprobs, job.num_logprobs, *_echoed_prompt(job, c)
            ).model_dump()
        choices.append(
            {
                "index": c.index,
                "text": prefix + c.text,
                "logprobs": logprobs,
                "finish_reason": c.finish_reason,
            }
        )
    return _envelope(service, job, "text_completion", choices) | {"usage": job.usage()}


def chat_body(service: GenerationService, job: Job) -> dict:
    choices = []
    for c in job.choices:
        content, calls, finish_reason = _tool_calls(job, c)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        logprobs = None if job.num_logprobs is None else service.chat_logprobs(c.logprobs).model_dump()
        choices.append(
            {"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
        )
    return _envelope(service, job, "chat.completion", choices) | {"usage": job.usage()}


def _tool_calls(job: Job, choice: Choice) -> tuple[str | None, list[dict], str | None]:
    """(content, tool calls, finish reason) of a finished chat choice. Only a complete output is parsed: one
    cut by max_tokens stays text with finish_reason "length". A named tool_choice finishes with "stop", as
    OpenAI does; a call the model chose (or was required to make) with "tool_calls"."""
    if job.tools is None or choice.finish_reason != "stop":
        return choice.text, [], choice.finish_reason
    content, calls = parse_tool_calls(job.tools, choice.text)
    if not calls:
        return choice.text, [], choice.finish_reason
    return content, calls, "stop" if job.tools.mode == "named" else "tool_calls"


def _envelope(service: GenerationService, job: Job, kind: str, choices: list[dict]) -> dict:
    return {
        "id": job.id,
        "object": kind,
        "created": job.created,
        "model": service.model_name,
        "choices": choices,
    }


# ---- streaming ------------------------------------------------------------------------------------
def stream(service: GenerationService, job: Job, render_chunk: Any, include_usage: bool) -> StreamingResponse:
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


def completion_chunk(
    service: GenerationService, job: Job, choice: Choice, out: RequestOutput, is_first: bool
) -> dict | None:
    text = out.delta_text
    echoed: tuple[list[int], list[TokenLogprob | None]] = ([], [])
    if is_first and job.echo_texts:
        text = job.echo_texts[choice.prompt_index] + text
        choice.text_offset = 0 if job.num_logprobs is not None else len(job.echo_texts[choice.prompt_index])
        echoed = _echoed_prompt(job, choice)
    if not text and not out.finished and not out.delta_logprobs:
        return None
    logprobs = None
    if job.num_logprobs is not None and (out.delta_logprobs or echoed[0]):
        logprobs = service.completion_logprobs(
            choice, out.delta_logprobs or [], job.num_logprobs, *echoed
        ).model_dump()
    c = {"index": choice.index, "text": text, "logprobs": logprobs, "finish_reason": out.finish_reason}
    return _envelope(service, job, "text_completion", [c])


def _echoed_prompt(job: Job, choice: Choice) -> tuple[list[int], list[TokenLogprob | None]]:
    """The prompt's ids and logprobs that an echo with logprobs lists before the output's."""
    if not job.echo_texts or choice.prompt_logprobs is None:
        return [], []
    return job.prompts[choice.prompt_index], choice.prompt_logprobs


def chat_chunk(
    service: GenerationService, job: Job, choice: Choice, out: RequestOutput, is_first: bool
) -> dict | None:
    if not out.delta_text and not out.finished and not out.delta_logprobs and not is_first:
        return None
    finish_reason = out.finish_reason
    delta: dict[str, Any] = {"content": out.delta_text}
    if job.tools is not None:  # the text is parsed once complete: it arrives with the last chunk
        delta = {}
        if out.finished:
            content, calls, finish_reason = _tool_calls(job, choice)
            delta = {"content": content} if not calls else {"content": content, "tool_calls": _indexed(calls)}
    if is_first:
        delta["role"] = "assistant"
    logprobs = None
    if job.num_logprobs is not None and out.delta_logprobs:
        logprobs = service.chat_logprobs(out.delta_logprobs).model_dump()
    c = {"index": choice.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return _envelope(service, job, "chat.completion.chunk", [c])


def _indexed(calls: list[dict]) -> list[dict]:
    return [{"index": i, **call} for i, call in enumerate(calls)]
