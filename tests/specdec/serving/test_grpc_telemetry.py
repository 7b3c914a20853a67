"""Trace context across a real grpc.aio channel and server in-process, and the per-RPC metrics."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from opentelemetry import trace
from prometheus_client import CollectorRegistry

from specdec.common.errors import InvalidFieldError
from specdec.serving.grpc_errors import ErrorMappingInterceptor
from specdec.serving.grpc_telemetry import ServerTelemetryInterceptor, role_of, trace_context_interceptors
from specdec.telemetry.metrics import RpcMetrics
from specdec.telemetry.tracing import build_tracer_provider
from specdec.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc, drafter_pb2, drafter_pb2_grpc


class FakeDrafter(drafter_pb2_grpc.DrafterServicer):
    def __init__(self):
        self.seen_span = None

    async def Propose(self, request, context):
        self.seen_span = trace.get_current_span().get_span_context()
        return drafter_pb2.ProposeResponse(draft_token_ids=[1, 2], draft_ns=5)

    async def Info(self, request, context):
        raise InvalidFieldError("model_id", "not today")


class FakeCoordinator(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self):
        self.seen_spans = []

    async def GenerateStream(self, request, context):
        for text in ("a", "b"):
            self.seen_spans.append(trace.get_current_span().get_span_context())
            yield coordinator_pb2.GenerateStreamResponse(text=text)


def run_calls():
    provider = build_tracer_provider("draft", "memory", 1.0)
    registry = CollectorRegistry()
    drafter, coordinator = FakeDrafter(), FakeCoordinator()

    async def scenario():
        server = grpc.aio.server(
            interceptors=[ServerTelemetryInterceptor(provider, RpcMetrics(registry)), ErrorMappingInterceptor()]
        )
        drafter_pb2_grpc.add_DrafterServicer_to_server(drafter, server)
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(coordinator, server)
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(
                f"127.0.0.1:{port}", interceptors=trace_context_interceptors()
            ) as channel:
                await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
                with provider.get_tracer("test").start_as_current_span("caller") as caller:
                    await drafter_pb2_grpc.DrafterStub(channel).Propose(
                        drafter_pb2.ProposeRequest(session_id="s1", base_len=7, num_speculative_tokens=2), timeout=10
                    )
                    try:
                        await drafter_pb2_grpc.DrafterStub(channel).Info(common_pb2.InfoRequest(), timeout=10)
                    except grpc.aio.AioRpcError as error:
                        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
                    replies = [
                        r.text
                        async for r in coordinator_pb2_grpc.CoordinatorStub(channel).GenerateStream(
                            coordinator_pb2.GenerateRequest(), timeout=10
                        )
                    ]
                    assert replies == ["a", "b"]
                return caller.get_span_context()
        finally:
            await server.stop(None)

    caller = asyncio.run(scenario())
    spans = {s.name: s for s in provider.memory_exporter.get_finished_spans()}
    return caller, spans, registry, drafter, coordinator


def test_server_spans_join_the_callers_trace_and_are_current_in_the_handler():
    caller, spans, _, drafter, coordinator = run_calls()
    propose = spans["specdec.v1.Drafter/Propose"]
    assert propose.context.trace_id == caller.trace_id and propose.parent.span_id == caller.span_id
    assert propose.kind == trace.SpanKind.SERVER
    assert propose.attributes["specdec.session_id"] == "s1" and propose.attributes["specdec.base_len"] == 7
    assert drafter.seen_span.span_id == propose.context.span_id
    stream = spans["specdec.v1.Coordinator/GenerateStream"]
    assert stream.context.trace_id == caller.trace_id
    assert [s.span_id for s in coordinator.seen_spans] == [stream.context.span_id] * 2
    info = spans["specdec.v1.Drafter/Info"]
    assert info.status.status_code == trace.StatusCode.ERROR
    assert info.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert not any(name.startswith("grpc.health") for name in spans)  # probes are not traced


def test_requests_and_errors_are_counted_by_method_and_status():
    _, _, registry, _, _ = run_calls()

    def requests(method: str, code: str, name: str = "specdec_grpc_server_requests_total"):
        return registry.get_sample_value(name, {"grpc_method": method, "grpc_code": code})

    assert requests("/specdec.v1.Drafter/Propose", "OK") == 1
    assert requests("/specdec.v1.Drafter/Info", "INVALID_ARGUMENT") == 1
    assert requests("/specdec.v1.Drafter/Info", "INVALID_ARGUMENT", "specdec_grpc_server_errors_total") == 1
    assert requests("/specdec.v1.Drafter/Propose", "OK", "specdec_grpc_server_errors_total") is None
    assert requests("/specdec.v1.Coordinator/GenerateStream", "OK") == 1
    assert requests("/grpc.health.v1.Health/Check", "OK") == 1
    assert (
        registry.get_sample_value(
            "specdec_grpc_server_handling_seconds_count", {"grpc_method": "/specdec.v1.Drafter/Propose"}
        )
        == 1
    )


def test_role_of_names_the_service():
    assert role_of(["specdec.v1.Verifier"]) == "verify"
    assert role_of(["specdec.v1.Drafter"]) == "draft"
    assert role_of(["specdec.v1.Coordinator"]) == "coordinator"
