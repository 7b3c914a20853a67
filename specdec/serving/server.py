"""What every server shares: a grpc.aio server with health, reflection and error mapping, drained on SIGTERM.

Health says readiness and liveness apart (specdec/serving/health_status.py). With a health port, a second,
plaintext server answers grpc.health.v1 and nothing else, from the same health servicer: kubelet's gRPC probes
cannot speak TLS, so a TLS port is probed there instead (`--health-port`).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specdec.serving.drain import SessionDrain
from specdec.serving.grpc_errors import ErrorMappingInterceptor
from specdec.serving.grpc_options import channel_options
from specdec.serving.grpc_telemetry import ServerTelemetryInterceptor, role_of
from specdec.serving.health_status import HealthStatus
from specdec.telemetry.tracing import setup_tracing_from_env

log = logging.getLogger(__name__)


@dataclass
class RunningServer:
    """A started server, the port it bound and its health (and the plaintext health-only server)."""

    server: grpc.aio.Server
    port: int
    health: HealthStatus
    stop_requested: asyncio.Event
    loop: asyncio.AbstractEventLoop
    health_server: grpc.aio.Server | None = None
    health_port: int = 0

    def end_health_from_thread(self, reason: str) -> None:
        """Turns health NOT_SERVING for good from any thread (a model process or a rank that died)."""
        asyncio.run_coroutine_threadsafe(self.health.end(reason), self.loop)

    async def stop(self, grace_s: float) -> None:
        """Stops taking new calls and lets in-flight ones finish for up to grace_s seconds."""
        await self.health.end("shutting down")
        await self.server.stop(grace_s)
        if self.health_server is not None:  # says NOT_SERVING through the drain, then goes
            await self.health_server.stop(0)


def configure_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


async def start_server(
    address: str,
    register: Callable[[grpc.aio.Server], None],
    service_names: Sequence[str],
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    credentials: grpc.ServerCredentials | None = None,
    health_port: int = 0,
    options: Sequence[tuple[str, int]] = (),
) -> RunningServer:
    """Binds address (port 0 picks a free one), registers the servicers, health and reflection, and starts.

    health_port > 0 also serves grpc.health.v1 alone, in plaintext, on that port of the address's host.
    options: more server options (specdec/serving/grpc_options.py), for the API port only.
    SIGTERM/SIGINT handlers are installed before it returns, so a signal right after start-up drains too.
    """
    setup_tracing_from_env(role_of(service_names))  # no-op where the service set tracing up from its settings
    server = grpc.aio.server(
        interceptors=[ServerTelemetryInterceptor(), *interceptors, ErrorMappingInterceptor()],
        options=[*channel_options(), *options],
    )
    register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"could not bind {address}")
    await server.start()
    loop = asyncio.get_running_loop()
    running = RunningServer(server, port, HealthStatus(health_servicer, service_names), asyncio.Event(), loop)
    if health_port:
        running.health_server, running.health_port = await start_health_server(address, health_port, health_servicer)
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, running.stop_requested.set)
    await running.health.start()
    log.info("serving %s on port %d", ", ".join(service_names), port)
    return running


async def start_health_server(
    address: str, health_port: int, health_servicer: health.HealthServicer
) -> tuple[grpc.aio.Server, int]:
    """A plaintext server on health_port of address's host with grpc.health.v1 only: no API, no reflection."""
    server = grpc.aio.server(options=channel_options())
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    health_address = f"{address.rpartition(':')[0]}:{health_port}"
    if server.add_insecure_port(health_address) == 0:
        raise OSError(f"could not bind the health port {health_address}")
    await server.start()
    log.info("serving grpc.health.v1 in plaintext on port %d", health_port)
    return server, health_port


async def wait_for_termination(running: RunningServer, grace_s: float, sessions: SessionDrain | None = None) -> None:
    """Serves until SIGTERM/SIGINT, then drains for up to grace_s seconds: a model service (`sessions`) first waits,
    unready (still live) and opening no new sessions, for its sessions to be moved or closed
    (specdec/serving/drain.py); then in-flight calls get what is left of the grace period."""
    serving = asyncio.ensure_future(running.server.wait_for_termination())
    stopping = asyncio.ensure_future(running.stop_requested.wait())
    await asyncio.wait([serving, stopping], return_when=asyncio.FIRST_COMPLETED)
    if running.stop_requested.is_set():
        log.info("signal received: draining for up to %.0fs", grace_s)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        if sessions is not None:
            await running.health.set_ready(False)
            await sessions.drain(grace_s)
        await running.stop(max(deadline - loop.time(), 0.0))
    serving.cancel()
    stopping.cancel()
