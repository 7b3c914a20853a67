"""The coordinator's injected network delay (`--replica-network-delay-ms`): every unary call to a replica waits the
delay before it is sent and after its answer arrives, a reply or an error; on a call stream every message waits it,
each way, the stream's error included; and the waits are woken in deadline order by the timer thread, not by the
event loop's millisecond timers."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from coordinator.network_delay import DelayedStreams, DelayedUnaryCalls, PreciseTimer, network_delay_interceptors


class RecordingTimer(PreciseTimer):
    """A PreciseTimer that notes each sleep it was asked for."""

    def __init__(self):
        super().__init__()
        self.asked: list[float] = []

    async def sleep(self, seconds: float) -> None:
        self.asked.append(seconds)
        await super().sleep(seconds)


async def _calls_through_a_delay(timer: RecordingTimer) -> list[str]:
    server = grpc.aio.server()
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    outcomes = []
    try:
        interceptor = DelayedUnaryCalls(0.002, timer)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", interceptors=[interceptor]) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            outcomes.append(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await stub.Check(health_pb2.HealthCheckRequest(service="unknown"), timeout=10)
            outcomes.append(error.value.code().name)
    finally:
        await server.stop(None)
    return outcomes


def test_both_ways_of_every_call_wait_the_delay_errors_included():
    timer = RecordingTimer()
    assert asyncio.run(_calls_through_a_delay(timer)) == ["SERVING", "NOT_FOUND"]
    assert timer.asked == [0.002] * 4


async def _echo(requests, context):
    """Echoes each message of a stream; "fail" ends it NOT_FOUND."""
    async for request in requests:
        if request == b"fail":
            await context.abort(grpc.StatusCode.NOT_FOUND, "no such thing")
        yield request


async def _stream_through_a_delay(timer: RecordingTimer, delay_s: float) -> tuple[list[bytes], str]:
    server = grpc.aio.server()
    handler = grpc.stream_stream_rpc_method_handler(_echo)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Echo", {"Echo": handler})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        interceptor = DelayedStreams(delay_s, timer)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", interceptors=[interceptor]) as channel:
            stream = channel.stream_stream("/test.Echo/Echo")(timeout=10)
            for message in (b"a", b"b", b"c"):  # written together: their delays overlap
                await stream.write(message)
            echoed = [await stream.read() for _ in range(3)]
            await stream.write(b"fail")
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await stream.read()
    finally:
        await server.stop(None)
    return echoed, error.value.code().name


def test_every_message_of_a_stream_waits_the_delay_each_way_its_error_too():
    timer, delay = RecordingTimer(), 0.05
    assert asyncio.run(_stream_through_a_delay(timer, delay)) == ([b"a", b"b", b"c"], "NOT_FOUND")
    # "a" out and back, "fail" out and its error back wait the whole delay; "b" and "c", sent and answered right
    # after "a", wait what is left of theirs (nothing, once "a"'s wait ran over)
    assert len([asked for asked in timer.asked if asked > delay / 2]) >= 4
    assert all(0 < asked <= delay for asked in timer.asked)


def test_waits_end_in_deadline_order():
    async def sleepers() -> list[float]:
        timer, woken = PreciseTimer(), []

        async def sleep(seconds: float) -> None:
            await timer.sleep(seconds)
            woken.append(seconds)

        await asyncio.gather(*(sleep(s) for s in (0.004, 0.0001, 0.002, 0.0005)))
        return woken

    assert asyncio.run(sleepers()) == [0.0001, 0.0005, 0.002, 0.004]


def test_no_delay_adds_no_interceptor_and_a_negative_one_is_refused():
    assert network_delay_interceptors(0) == []
    assert [type(i) for i in network_delay_interceptors(0.1)] == [DelayedUnaryCalls, DelayedStreams]
    with pytest.raises(ValueError, match="^replica_network_delay_ms must be >= 0"):
        network_delay_interceptors(-0.1)
