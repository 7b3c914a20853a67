"""Readiness apart from liveness (specdec/serving/health_status.py), through a real server's plaintext health port:
readiness ("" and the API service) follows dependencies while liveness stays SERVING, so kubelet takes an unready
pod out of its Service without restarting it; liveness turns NOT_SERVING only once the process stops serving for
good (it shuts down, or a part of it died), and readiness cannot come back after that."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.redis_server import free_port
from specdec.serving.health_status import LIVENESS
from specdec.serving.server import start_server
from specdec.v1 import drafter_pb2, drafter_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
DRAFTER = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name


async def statuses(port: int) -> dict[str, int]:
    """What a probe of each name would read: readiness (""), the API service, liveness."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return {
            name: (await stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)).status
            for name in ("", DRAFTER, LIVENESS)
        }


def test_readiness_follows_dependencies_and_liveness_only_the_process():
    async def scenario():
        running = await start_server(
            "127.0.0.1:0",
            lambda server: drafter_pb2_grpc.add_DrafterServicer_to_server(drafter_pb2_grpc.DrafterServicer(), server),
            [DRAFTER],
            health_port=free_port(),
        )
        try:
            assert await statuses(running.health_port) == {"": SERVING, DRAFTER: SERVING, LIVENESS: SERVING}
            # A dependency is gone (the coordinator's last verify replica): unready, not dead.
            await running.health.set_ready(False)
            assert await statuses(running.health_port) == {"": NOT_SERVING, DRAFTER: NOT_SERVING, LIVENESS: SERVING}
            await running.health.set_ready(True)
            assert await statuses(running.health_port) == {"": SERVING, DRAFTER: SERVING, LIVENESS: SERVING}
            # A part of the process died (its model process, a rank): only a restart mends it.
            running.end_health_from_thread("the model process exited (-9)")
            await asyncio.sleep(0.1)
            assert await statuses(running.health_port) == {"": NOT_SERVING, DRAFTER: NOT_SERVING, LIVENESS: NOT_SERVING}
            await running.health.set_ready(True)  # a dependency coming back does not revive it
            assert await statuses(running.health_port) == {"": NOT_SERVING, DRAFTER: NOT_SERVING, LIVENESS: NOT_SERVING}
            assert running.health.ended == "the model process exited (-9)"
        finally:
            await running.stop(0)

    asyncio.run(scenario())


def test_a_draining_server_says_not_serving_on_every_name():
    async def scenario():
        running = await start_server("127.0.0.1:0", lambda server: None, [DRAFTER], health_port=free_port())
        await running.health.set_ready(False)  # unready before the signal: still alive
        assert (await statuses(running.health_port))[LIVENESS] == SERVING
        await running.health.end("shutting down")  # what stop() says first, through the drain
        assert await statuses(running.health_port) == {"": NOT_SERVING, DRAFTER: NOT_SERVING, LIVENESS: NOT_SERVING}
        await running.stop(0)

    asyncio.run(scenario())
