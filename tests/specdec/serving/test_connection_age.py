"""`--max-connection-age-s` (the coordinator's): the server asks each client connection to close (HTTP/2 GOAWAY)
once it is that old, so a client leaves its connection without doing anything, reconnects on its next call and
resolves the name again; behind a headless Service that is how coordinator replicas an autoscaler added get
traffic. Off (no option) by default."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.serving.grpc_options import connection_age_options
from specdec.serving.server import start_server


async def connected_channel(port: int) -> grpc.aio.Channel:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert channel.get_state() == grpc.ChannelConnectivity.READY
    return channel


def test_an_old_connection_is_closed_by_the_server_and_the_client_reconnects():
    async def scenario():
        running = await start_server("127.0.0.1:0", lambda s: None, [], options=connection_age_options(0.5, 5))
        channel = await connected_channel(running.port)
        try:
            await asyncio.wait_for(channel.wait_for_state_change(grpc.ChannelConnectivity.READY), timeout=30)
            assert channel.get_state() != grpc.ChannelConnectivity.READY  # the server's GOAWAY, no client action
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING  # on a new connection
        finally:
            await channel.close()
            await running.stop(0)

    asyncio.run(scenario())


def test_without_an_age_connections_stay():
    assert connection_age_options(0, 600) == []
    assert connection_age_options(300, 600) == [
        ("grpc.max_connection_age_ms", 300_000),
        ("grpc.max_connection_age_grace_ms", 600_000),
    ]
    with pytest.raises(ValueError, match="max_connection_age_s and max_connection_age_grace_s must be >= 0"):
        connection_age_options(-1, 600)
