"""OpenTelemetry traces of the HTTP server: one span per API request, child spans per choice for its queue,
prefill, decode and detokenize time, attributes named as vLLM names them (``gen_ai.*``).

Off unless ``--otlp-traces-endpoint`` is given; then the W3C ``traceparent`` a client sends becomes the
parent, and spans go to that OTLP endpoint (the exporter also reads the standard ``OTEL_EXPORTER_OTLP_*``
variables: headers, timeout, certificates; ``OTEL_SERVICE_NAME`` names the service). Needs the ``otel``
extra (``pip install 'mcp2026[otel]'``); without it, asking for traces fails at start with that command.
Off costs nothing: the SDK is not even imported (~0.1 s and several MB of start-up), no middleware is
installed and the service holds no tracer.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Sequence
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mcp2026.errors import MCPError

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Tracer

INSTALL_HINT = "pip install 'mcp2026[otel]'"
TRACED_PATH_PREFIX = "/v1/"  # probes and /metrics scrapes would bury the requests in noise


class TracingUnavailable(MCPError):
    """Traces were asked for but the OpenTelemetry SDK (or the asked exporter) is not installed."""


@functools.cache
def _sdk() -> SimpleNamespace:
    """The SDK's parts we use, imported the first time traces are asked for (the otel extra: without it the
    server runs untraced, and asking for traces raises TracingUnavailable)."""
    try:
        from opentelemetry import trace  # the otel extra, deferred: ~0.1 s of every start-up otherwise
        from opentelemetry.sdk.resources import Resource  # otel extra, deferred
        from opentelemetry.sdk.trace import TracerProvider  # otel extra, deferred
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor  # otel extra
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator  # otel extra
    except ImportError:
        raise TracingUnavailable(
            f"OpenTelemetry tracing needs the OpenTelemetry SDK, which is not installed: {INSTALL_HINT}"
        ) from None
    return SimpleNamespace(
        trace=trace,
        Resource=Resource,
        TracerProvider=TracerProvider,
        BatchSpanProcessor=BatchSpanProcessor,
        SimpleSpanProcessor=SimpleSpanProcessor,
        TraceContextTextMapPropagator=TraceContextTextMapPropagator,
    )


def otlp_exporter(endpoint: str) -> SpanExporter:
    """The OTLP span exporter for ``endpoint``: http/protobuf (``.../v1/traces``) by default, gRPC when
    ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` (or ``OTEL_EXPORTER_OTLP_PROTOCOL``) says ``grpc``."""
    _sdk()
    protocol = os.environ.get(
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    )
    try:
        if protocol == "grpc":
            # optional: the gRPC exporter is a package of its own, imported only when this protocol is asked
            from opentelemetry.exporter.otlp.proto.grpc import trace_exporter
        elif protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http import trace_exporter  # optional: the otel extra's
        else:
            raise TracingUnavailable(
                f"OTLP protocol {protocol!r} is not supported: use http/protobuf or grpc"
            )
    except ImportError:
        package = "opentelemetry-exporter-otlp-proto-" + ("grpc" if protocol == "grpc" else "http")
        raise TracingUnavailable(
            f"the OTLP {protocol} exporter is not installed: pip install {package}"
        ) from None
    return trace_exporter.OTLPSpanExporter(endpoint=endpoint)


class Tracing:
    """The server's tracer: TracingMiddleware opens the request span, ``record(job)`` adds what the engine did."""

    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer
        self.trace = _sdk().trace
        self.propagator = _sdk().TraceContextTextMapPropagator()

    @classmethod
    def with_exporter(cls, exporter: SpanExporter, batch: bool = True) -> Tracing:
        """A tracer of its own provider (the process-global one is left alone), spans sent to ``exporter``
        in batches off the request path (``batch=False``: as each span ends, for tests)."""
        sdk = _sdk()
        # Resource.create reads OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES; ours is only the default name.
        resource = sdk.Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", "mcp2026")})
        provider = sdk.TracerProvider(resource=resource)
        processor = sdk.BatchSpanProcessor(exporter) if batch else sdk.SimpleSpanProcessor(exporter)
        provider.add_span_processor(processor)
        return cls(provider.get_tracer("mcp2026.serve"))

    @classmethod
    def from_endpoint(cls, endpoint: str) -> Tracing:
        return cls.with_exporter(otlp_exporter(endpoint))

    def record(self, job: Any, model_name: str) -> None:
        """Attributes of the finished ``job`` (a serve.generation Job, not imported: generation imports us)
        on the current request span, and one set of child spans per choice. Called by GenerationService.release
        inside the request's context."""
        trace = self.trace
        span = trace.get_current_span()
        if not span.is_recording():
            return  # released outside a traced request (e.g. a path we do not trace)
        span.set_attributes(_job_attributes(job, model_name))
        if any(c.finish_reason == "error" for c in job.choices):
            span.set_status(trace.Status(trace.StatusCode.ERROR, "a choice finished with an error"))
        parent = trace.set_span_in_context(span)
        to_ns = _clock_to_epoch_ns()
        for choice in job.choices:
            for name, start, end, attrs in _phases(choice):
                child = self.tracer.start_span(name, context=parent, start_time=to_ns(start))
                child.set_attributes({"gen_ai.choice.index": choice.index, **attrs})
                child.end(end_time=to_ns(end))


def _clock_to_epoch_ns() -> Any:
    """Engine times are perf_counter seconds; spans want epoch nanoseconds."""
    offset_ns = time.time_ns() - time.perf_counter_ns()
    return lambda t: int(t * 1e9) + offset_ns


def _phases(choice: Any) -> Sequence[tuple[str, float, float, dict[str, Any]]]:
    """(name, start, end, attributes) of the phases this choice went through; a phase it never reached
    (aborted in the queue, say) has no span."""
    arrival, scheduled = choice.timing.arrival_time, choice.timing.scheduled_time
    first, last = choice.first_token_time, choice.last_output_time
    phases: list[tuple[str, float, float, dict[str, Any]]] = []
    if scheduled is not None:
        phases.append(("queue", arrival, scheduled, {}))
        if first is not None:
            phases.append(
                ("prefill", scheduled, first, {"gen_ai.usage.prompt_tokens": choice.num_prompt_tokens})
            )
    if first is not None and last is not None:
        phases.append(("decode", first, last, {"gen_ai.usage.completion_tokens": choice.num_output_tokens}))
        # NOTE: detokenizing is interleaved with decoding, a token at a time; the span is its summed time,
        # laid from the first token, so its length (not its place) is what it tells.
        detok = choice.detokenize_s
        phases.append(("detokenize", first, first + detok, {"mcp2026.detokenize.is_summed": True}))
    return phases


def _job_attributes(job: Any, model_name: str) -> dict[str, Any]:
    choices = job.choices
    params = job.params[0]
    arrival = min(c.timing.arrival_time for c in choices)
    attrs: dict[str, Any] = {
        "gen_ai.request.id": job.id,
        "gen_ai.request.model": model_name,
        "gen_ai.response.model": model_name,
        "gen_ai.request.n": job.n,
        "gen_ai.request.max_tokens": params.max_tokens,
        "gen_ai.request.temperature": params.temperature,
        "gen_ai.request.top_p": params.top_p,
        "gen_ai.usage.prompt_tokens": sum(len(p) for p in job.prompts),
        "gen_ai.usage.completion_tokens": sum(c.num_output_tokens for c in choices),
        "gen_ai.usage.num_sequences": len(choices),
        "gen_ai.response.finish_reasons": [c.finish_reason or "abort" for c in choices],
        "mcp2026.tenant": job.tenant.name,
    }
    queued = [c.timing.queue_time_s for c in choices if c.timing.queue_time_s is not None]
    if queued:
        attrs["gen_ai.latency.time_in_queue"] = min(queued)
    firsts = [c.first_token_time for c in choices if c.first_token_time is not None]
    if firsts:
        attrs["gen_ai.latency.time_to_first_token"] = min(firsts) - arrival
    ends = [c.last_output_time for c in choices if c.last_output_time is not None]
    if ends and all(c.finish_reason is not None for c in choices):
        attrs["gen_ai.latency.e2e"] = max(ends) - arrival
    return attrs


class TracingMiddleware:
    """The request span around each /v1/ call, parented on the client's ``traceparent`` when it sends one."""

    def __init__(self, app: ASGIApp, tracing: Tracing) -> None:
        self.app = app
        self.tracing = tracing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(TRACED_PATH_PREFIX):
            await self.app(scope, receive, send)
            return
        carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        parent = self.tracing.propagator.extract(carrier)
        name = f"{scope['method']} {scope['path']}"
        trace = self.tracing.trace
        with self.tracing.tracer.start_as_current_span(
            name, context=parent, kind=trace.SpanKind.SERVER
        ) as span:
            span.set_attributes({"http.request.method": scope["method"], "url.path": scope["path"]})

            async def send_traced(message: Message) -> None:
                if message["type"] == "http.response.start":
                    status = message["status"]
                    span.set_attribute("http.response.status_code", status)
                    if status >= 500:
                        span.set_status(trace.Status(trace.StatusCode.ERROR))
                await send(message)

            await self.app(scope, receive, send_traced)
