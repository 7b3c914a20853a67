"""Pools of draft or verify replicas: channels, stubs and session counts for least-loaded placement."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.speculation_policy import PassLoad
from specdec.errors import DownstreamUnavailableError
from specdec.grpc_options import channel_options
from specdec.step_cost import StepCost
from specdec.telemetry.grpc_telemetry import trace_context_interceptors
from specdec.tls import open_aio_channel
from specdec.v1 import common_pb2

log = logging.getLogger(__name__)
StubT = TypeVar("StubT")


@dataclass
class Replica(Generic[StubT]):
    """One service replica: its address, channel, stub and the sessions this coordinator placed on it."""

    address: str
    channel: grpc.aio.Channel
    stub: StubT
    active_sessions: int = 0
    info: common_pb2.ServiceInfo | None = field(default=None)
    remote_sessions: int = 0  # sessions other coordinators hold here (coordinator/session_registry.py)
    healthy: bool = True  # False after a call found it gone, until its health check says SERVING again
    load: PassLoad | None = None  # its measured pass cost and batch size, from Info and then every reply


class ReplicaPool(Generic[StubT]):
    """Spreads sessions over replicas by load (fewest active sessions); a session stays on its replica.
    Channels use TLS when given credentials (specdec/tls.py)."""

    def __init__(
        self,
        kind: str,
        addresses: Sequence[str],
        make_stub: Callable[[grpc.aio.Channel], StubT],
        credentials: grpc.ChannelCredentials | None = None,
        options: Sequence[tuple[str, str]] = (),
    ):
        if not addresses:
            raise ValueError(f"{kind}_replicas: at least one address is needed")
        self.kind = kind
        self.on_health_change: Callable[[], None] | None = None  # a replica left placement or came back
        self._probes: set[asyncio.Future] = set()
        self.replicas: list[Replica[StubT]] = []
        for address in addresses:
            channel = open_aio_channel(
                address, credentials, [*channel_options(), *options], interceptors=trace_context_interceptors()
            )
            self.replicas.append(Replica(address, channel, make_stub(channel)))

    def acquire(self, required: bool = True) -> Replica[StubT] | None:
        """The least-loaded healthy replica (counting every coordinator's sessions), counted as holding one more
        session. With none healthy: None when not required (run without it), else the least-loaded one."""
        candidates = [r for r in self.replicas if r.healthy]
        if not candidates and not required:
            return None
        replica = min(candidates or self.replicas, key=lambda r: r.active_sessions + r.remote_sessions)
        replica.active_sessions += 1
        return replica

    @property
    def any_healthy(self) -> bool:
        return any(r.healthy for r in self.replicas)

    def mark_unhealthy(self, replica: Replica[StubT], probe_interval_s: float = 1.0) -> None:
        """Takes a replica out of placement (a call found it gone or past its deadline) and probes its health
        until it serves again."""
        if not replica.healthy:
            return
        replica.healthy = False
        log.warning(
            "%s replica %s marked unhealthy; probing it every %.0fs (%d of %d healthy)",
            self.kind,
            replica.address,
            probe_interval_s,
            sum(r.healthy for r in self.replicas),
            len(self.replicas),
        )
        if self.on_health_change is not None:
            self.on_health_change()

        async def probe() -> None:
            health = health_pb2_grpc.HealthStub(replica.channel)
            while not replica.healthy:
                await asyncio.sleep(probe_interval_s)
                try:
                    reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=probe_interval_s)
                    replica.healthy = reply.status == health_pb2.HealthCheckResponse.SERVING
                except grpc.aio.AioRpcError:
                    continue
            log.info("%s replica %s is healthy again", self.kind, replica.address)
            if self.on_health_change is not None:
                self.on_health_change()

        self._probes.add(task := asyncio.ensure_future(probe()))
        task.add_done_callback(self._probes.discard)

    @staticmethod
    def release(replica: Replica[StubT]) -> None:
        replica.active_sessions -= 1

    async def wait_ready(self, timeout_s: float) -> None:
        """Waits until every replica answers Info (fetching it), or raises DownstreamUnavailableError."""

        async def one(replica: Replica[StubT]) -> None:
            deadline = asyncio.get_running_loop().time() + timeout_s
            health = health_pb2_grpc.HealthStub(replica.channel)
            while True:
                try:
                    status = await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
                    if status.status == health_pb2.HealthCheckResponse.SERVING:
                        replica.info = await replica.stub.Info(common_pb2.InfoRequest(), timeout=5)
                        replica.load = PassLoad(
                            StepCost(replica.info.step_cost_fixed_ns, replica.info.step_cost_per_token_ns)
                        )
                        return
                except grpc.aio.AioRpcError as error:
                    if asyncio.get_running_loop().time() > deadline:
                        raise DownstreamUnavailableError(
                            f"{self.kind} replica {replica.address} not ready after {timeout_s:.0f}s: "
                            f"{error.code().name}"
                        ) from None
                await asyncio.sleep(0.5)

        await asyncio.gather(*(one(r) for r in self.replicas))
        log.info("%s replicas ready: %s", self.kind, ", ".join(r.address for r in self.replicas))

    async def close(self) -> None:
        await asyncio.gather(*(r.channel.close() for r in self.replicas))
