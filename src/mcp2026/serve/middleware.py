"""Per-request plumbing of the HTTP server: the request id (accepted from ``X-Request-Id`` or made), echoed,
logged with each request, and carried to the log lines of the handlers through a context variable; the
request body limit.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from contextvars import ContextVar

from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mcp2026.serve.errors import error_body

log = logging.getLogger("mcp2026.serve")
REQUEST_ID: ContextVar[str] = ContextVar("request_id", default="-")
_REQUEST_ID_OK = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


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


class BodyLimitMiddleware:
    """A 413 for a request body over ``max_bytes``: at once when ``Content-Length`` says so, else as soon as
    the streamed (chunked) body passes the limit, so an oversized body is never held in memory whole."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _message(self) -> str:
        return (
            f"the request body is over this server's limit of {self.max_bytes} bytes; send a smaller "
            "request (the limit is the serve config's max_request_body_bytes)"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            body = json.dumps(error_body(413, self._message(), code="request_too_large")).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            await send({"type": "http.response.start", "status": 413, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # FastAPI lets an HTTPException out of its body reading; the error handlers shape it
                    raise HTTPException(413, self._message())
            return message

        await self.app(scope, limited_receive, send)
