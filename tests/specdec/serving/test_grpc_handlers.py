"""A cancelled stream runs its handler's cleanup at once, inside the RPC's own trace context, through the serving
stack's interceptors."""

from __future__ import annotations

import asyncio
import logging

import grpc
from opentelemetry import trace

from specdec.serving.grpc_errors import ErrorMappingInterceptor
from specdec.serving.grpc_telemetry import ServerTelemetryInterceptor
from specdec.telemetry.tracing import build_tracer_provider
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc

CLEANUP_WAIT_S = 5.0


class EndlessStream(coordinator_pb2_grpc.CoordinatorServicer):
    """Streams until cancelled, faster than the client reads (so it waits at a `yield` while its replies are written);
    records the span current while it streams and while its `finally` runs."""

    def __init__(self):
        self.cleaned_up = asyncio.Event()
        self.streaming_span = None
        self.cleanup_span = None

    async def GenerateStream(self, request, context):
        self.streaming_span = trace.get_current_span().get_span_context()
        try:
            while True:
                yield coordinator_pb2.GenerateStreamResponse(text="x" * 65536)
        finally:
            self.cleanup_span = trace.get_current_span().get_span_context()
            self.cleaned_up.set()


async def cancel_after_one_reply() -> EndlessStream:
    """A stream through the interceptors every service runs, cancelled by its client after the first reply."""
    servicer = EndlessStream()
    provider = build_tracer_provider("coordinator", "memory", 1.0)
    server = grpc.aio.server(interceptors=[ServerTelemetryInterceptor(provider), ErrorMappingInterceptor()])
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = coordinator_pb2_grpc.CoordinatorStub(channel).GenerateStream(
                coordinator_pb2.GenerateRequest(), timeout=30
            )
            await call.read()
            call.cancel()
            await asyncio.wait_for(servicer.cleaned_up.wait(), CLEANUP_WAIT_S)
        return servicer
    finally:
        await server.stop(None)


def test_a_cancelled_stream_cleans_up_in_its_own_context(caplog):
    with caplog.at_level(logging.ERROR):
        servicer = asyncio.run(cancel_after_one_reply())
    assert servicer.streaming_span.is_valid
    assert servicer.cleanup_span == servicer.streaming_span, "the handler's cleanup ran outside the RPC's context"
    assert not [r for r in caplog.records if "detach" in r.getMessage()], "the RPC's trace context leaked"
