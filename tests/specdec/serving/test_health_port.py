"""The plaintext health-only port (`--health-port`, specdec/serving/server.py) next to a mutual-TLS API port: it
answers grpc.health.v1 from the same servicer as the TLS port and serves nothing else, while the TLS port
keeps refusing plaintext. (tests/coordinator/test_tls.py checks the same on the real services.)"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from certs import make_pki
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from specdec.redis_server import free_port
from specdec.serving.server import start_server
from specdec.serving.tls import ServerTlsSettings, server_credentials
from specdec.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
DRAFTER = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name


async def health_status(port: int, service: str = "") -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return (await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)).status


async def plaintext_error(port: int, call) -> grpc.StatusCode:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await call(channel)
    return raised.value.code()


def check(channel):
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)


def info(channel):
    return drafter_pb2_grpc.DrafterStub(channel).Info(common_pb2.InfoRequest(), timeout=5)


async def list_services(channel):
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    async for reply in stub.ServerReflectionInfo(iter([request]), timeout=5):
        return reply


def test_health_port_answers_in_plaintext_and_serves_nothing_else(tmp_path):
    pki = make_pki(tmp_path)
    settings = ServerTlsSettings(str(pki.server.cert), str(pki.server.key), str(pki.ca.cert), free_port())

    async def scenario():
        running = await start_server(
            "127.0.0.1:0",
            lambda server: drafter_pb2_grpc.add_DrafterServicer_to_server(drafter_pb2_grpc.DrafterServicer(), server),
            [DRAFTER],
            credentials=server_credentials(settings),
            health_port=settings.health_port,
        )
        try:
            assert running.health_port == settings.health_port
            assert await health_status(settings.health_port) == SERVING
            assert await health_status(settings.health_port, DRAFTER) == SERVING
            # The API is not on the health port, nor is reflection; the TLS port refuses plaintext.
            assert await plaintext_error(settings.health_port, info) == grpc.StatusCode.UNIMPLEMENTED
            assert await plaintext_error(settings.health_port, list_services) == grpc.StatusCode.UNIMPLEMENTED
            assert await plaintext_error(running.port, info) == grpc.StatusCode.UNAVAILABLE
            # One health servicer: what the TLS port says, the health port says.
            await running.health.set_ready(False)
            assert await health_status(settings.health_port) == NOT_SERVING
            assert await health_status(settings.health_port, DRAFTER) == NOT_SERVING
        finally:
            await running.stop(0)
        assert await plaintext_error(settings.health_port, check) == grpc.StatusCode.UNAVAILABLE  # gone with it

    asyncio.run(scenario())


def test_no_health_port_by_default():
    assert ServerTlsSettings().health_port == 0
