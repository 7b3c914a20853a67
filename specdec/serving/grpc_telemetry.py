"""Trace context over gRPC metadata (W3C traceparent) and per-RPC spans and metrics, for grpc.aio.

Client side, `trace_context_interceptors()` write the current span's context into each call's metadata.
Server side, `ServerTelemetryInterceptor` (installed by specdec.serving.server.start_server on every service)
reads it, runs the handler inside a SERVER span that joins the caller's trace, and counts the RPC by
method and final status. Installed outermost, it sees the status the error mapping chose.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from specdec.serving.grpc_handlers import wrap_handler
from specdec.telemetry.metrics import RpcMetrics, rpc_metrics
from specdec.telemetry.tracing import TRACER_NAME

ROLES = {"Coordinator": "coordinator", "Drafter": "draft", "Verifier": "verify"}
# Health and reflection calls are counted but not traced (probes would flood the traces).
UNTRACED_PREFIXES = ("/grpc.health.", "/grpc.reflection.")
# Request fields copied onto the server span when the message has them.
TRACED_REQUEST_FIELDS = ("request_id", "session_id", "base_len")


def role_of(service_names: Sequence[str]) -> str:
    """The role (coordinator, draft, verify) of a server from the gRPC services it registers."""
    for name in service_names:
        short = name.rpartition(".")[2]
        if short in ROLES:
            return ROLES[short]
    return service_names[0].rpartition(".")[2].lower() if service_names else "server"


def _with_trace_context(details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    if not carrier:
        return details
    metadata = grpc.aio.Metadata(*(details.metadata or ()), *carrier.items())
    return grpc.aio.ClientCallDetails(
        details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
    )


class _UnaryUnaryTraceContext(grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(_with_trace_context(client_call_details), request)


class _UnaryStreamTraceContext(grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(_with_trace_context(client_call_details), request)


def trace_context_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """Client interceptors adding the caller's trace context to unary and server-streaming calls' metadata
    (one object per call type: a grpc.aio channel files each interceptor under one type only)."""
    return [_UnaryUnaryTraceContext(), _UnaryStreamTraceContext()]


def _final_code(context: grpc.aio.ServicerContext, error: BaseException | None) -> grpc.StatusCode:
    if isinstance(error, asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code
    if error is not None and not isinstance(error, grpc.aio.AbortError):
        return grpc.StatusCode.UNKNOWN
    return grpc.StatusCode.OK


@dataclass
class ObservedCall:
    """The status a call observed by ServerTelemetryInterceptor.observed ended with."""

    code: grpc.StatusCode = grpc.StatusCode.OK


class ServerTelemetryInterceptor(grpc.aio.ServerInterceptor):
    """A SERVER span per RPC in the caller's trace, plus request/error counts and latency by method and status."""

    def __init__(self, tracer_provider: trace.TracerProvider | None = None, metrics: RpcMetrics | None = None):
        self._tracer = trace.get_tracer(TRACER_NAME, tracer_provider=tracer_provider)
        self._metrics = metrics or rpc_metrics()

    @contextlib.contextmanager
    def observed(self, method: str, request, carrier: Mapping[str, str]) -> Iterator[ObservedCall]:
        """A call's SERVER span (in the trace `carrier` names) and its count and latency, by the status the body
        sets on the yielded ObservedCall; the span is current meanwhile."""
        started = time.perf_counter()
        call = ObservedCall()
        span = token = None
        if not method.startswith(UNTRACED_PREFIXES):
            parent = propagate.extract(carrier)
            span = self._tracer.start_span(
                method.lstrip("/"),
                context=parent,
                kind=SpanKind.SERVER,
                attributes={"rpc.system": "grpc", "rpc.method": method},
            )
            for field in TRACED_REQUEST_FIELDS:
                if hasattr(request, field):
                    span.set_attribute(f"specdec.{field}", getattr(request, field))
            token = otel_context.attach(trace.set_span_in_context(span, parent))
        try:
            yield call
        finally:
            self._metrics.observe(method, call.code.name, time.perf_counter() - started)
            if span is not None:
                span.set_attribute("rpc.grpc.status_code", call.code.value[0])
                if call.code != grpc.StatusCode.OK:
                    span.set_status(Status(StatusCode.ERROR, call.code.name))
                span.end()
                otel_context.detach(token)

    @contextlib.asynccontextmanager
    async def _observe(self, method: str, request, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        metadata = {key: value for key, value in (context.invocation_metadata() or ()) if isinstance(value, str)}
        with self.observed(method, request, metadata) as call:
            error: BaseException | None = None
            try:
                yield
            except BaseException as raised:
                error = raised
                raise
            finally:
                call.code = _final_code(context, error)

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None:
            return None
        return wrap_handler(handler, functools.partial(self._observe, details.method))
