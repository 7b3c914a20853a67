"""Pools of draft or verify replicas: channels, stubs and session counts for least-loaded placement."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.background_tasks import BackgroundTasks
from coordinator.speculation_policy import PassLoad
from specdec.common.errors import DownstreamUnavailableError
from specdec.engine.step_cost import StepCost
from specdec.serving.grpc_options import channel_options
from specdec.serving.grpc_telemetry import trace_context_interceptors
from specdec.serving.tls import open_aio_channel
from specdec.v1 import common_pb2

log = logging.getLogger(__name__)
StubT = TypeVar("StubT")
# A replica that restarts at its address (a rolling restart, a crash) is reconnected to within 2 s, not after gRPC's
# backoff of up to two minutes, so that its health probe puts it back into placement as soon as it serves.
REPLICA_CHANNEL_OPTIONS = [("grpc.max_reconnect_backoff_ms", 2000)]


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
    retired: bool = False  # gone from DNS: out of placement, its channel closed once unused
    pending_closes: int = 0  # CloseSession retries still to be sent here (coordinator/close_retry.py)

    @property
    def unused(self) -> bool:
        """Retired with no session and no close retry left: its channel can close (a call on a closed channel
        may hang or crash the process, so nothing may call it after that)."""
        return self.retired and self.active_sessions == 0 and self.pending_closes == 0


def health_check(replica: Replica, timeout_s: float) -> grpc.aio.UnaryUnaryCall:
    """The replica's readiness, over its channel of the moment (ReplicaPool.renew_channels replaces it)."""
    return health_pb2_grpc.HealthStub(replica.channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)


class ReplicaPool(Generic[StubT]):
    """Spreads sessions over replicas by load (fewest active sessions); a session stays on its replica.
    Channels use TLS when given credentials (specdec/serving/tls.py). Replicas join and retire while it serves
    (coordinator/replica_discovery.py)."""

    def __init__(
        self,
        kind: str,
        addresses: Sequence[str],
        make_stub: Callable[[grpc.aio.Channel], StubT],
        credentials: grpc.ChannelCredentials | None = None,
        options: Sequence[tuple[str, str]] = (),
        interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
    ):
        if not addresses:
            raise ValueError(f"{kind}_replicas: at least one address is needed")
        self.kind = kind
        self.on_health_change: Callable[[], None] | None = None  # a replica left placement, came back or joined
        self._make_stub = make_stub
        self._credentials = credentials
        self._options = [*channel_options(), *REPLICA_CHANNEL_OPTIONS, *options]
        self._interceptors = [*trace_context_interceptors(), *interceptors]  # plus any of the caller's (a delay)
        self._tasks = BackgroundTasks()  # health probes and channel closes in flight
        self.replicas: list[Replica[StubT]] = [self.open(address) for address in addresses]

    def open(self, address: str) -> Replica[StubT]:
        """A replica with its channel open, not yet in placement (see join)."""
        channel = open_aio_channel(address, self._credentials, self._options, interceptors=self._interceptors)
        return Replica(address, channel, self._make_stub(channel))

    def renew_channels(self, credentials: grpc.ChannelCredentials | None, grace_s: float) -> None:
        """New client credentials (a renewed certificate, another CA): every replica in placement gets a new
        channel with them, which its next calls use; calls already on the old channel get grace_s to finish
        before it closes. Retired replicas finish on their old channels."""
        self._credentials = credentials
        for replica in self.replicas:
            old = replica.channel
            replica.channel = self.open(replica.address).channel
            replica.stub = self._make_stub(replica.channel)
            self._tasks.start(old.close(grace_s))
        log.info("%s replicas: %d channels reopened with renewed TLS credentials", self.kind, len(self.replicas))

    def acquire(self, required: bool = True) -> Replica[StubT] | None:
        """The least-loaded healthy replica (counting every coordinator's sessions), counted as holding one more
        session. With none healthy: None when not required (run without it), else the least-loaded one."""
        candidates = [r for r in self.replicas if r.healthy]
        if not candidates and not required:
            return None
        replica = min(candidates or self.replicas, key=lambda r: r.active_sessions + r.remote_sessions)
        replica.active_sessions += 1
        return replica

    def acquire_instead(self, tried: Collection[Replica[StubT]]) -> Replica[StubT] | None:
        """For a session moving off a replica: the least-loaded healthy one not in `tried` (the one it leaves and
        those that failed to take it), else the least-loaded other one (its probe may lag behind its restart: the
        open will tell), counted as holding one more session; None when every replica was tried."""
        others = [r for r in self.replicas if r not in tried]
        candidates = [r for r in others if r.healthy] or others
        if not candidates:
            return None
        replica = min(candidates, key=lambda r: r.active_sessions + r.remote_sessions)
        replica.active_sessions += 1
        return replica

    def release(self, replica: Replica[StubT]) -> None:
        """One session on the replica ended; a retired replica's channel closes once it is unused."""
        replica.active_sessions -= 1
        if replica.unused:
            self._tasks.start(replica.channel.close())

    @property
    def any_healthy(self) -> bool:
        return any(r.healthy for r in self.replicas)

    def _healthy_count(self) -> str:
        return f"{sum(r.healthy for r in self.replicas)} of {len(self.replicas)} healthy"

    def join(self, replica: Replica[StubT]) -> None:
        """Puts a ready replica (its Info read) into placement."""
        self.replicas.append(replica)
        log.info("%s replica %s joined placement (%s)", self.kind, replica.address, self._healthy_count())
        self._health_changed()

    def retire(self, replica: Replica[StubT]) -> None:
        """Takes a replica out of placement for good (its address is gone); sessions on it run to their end, then
        its channel closes. A replica being probed stops being probed before its next check."""
        self.replicas.remove(replica)
        replica.retired = True
        log.info(
            "%s replica %s left placement; %d of its sessions still running (%s)",
            self.kind,
            replica.address,
            replica.active_sessions,
            self._healthy_count(),
        )
        if replica.unused:
            self._tasks.start(replica.channel.close())
        self._health_changed()

    def mark_unhealthy(self, replica: Replica[StubT], probe_interval_s: float = 1.0) -> None:
        """Takes a replica out of placement (a call found it gone or past its deadline) and probes its health
        until it serves again or retires."""
        if not replica.healthy or replica.retired:
            return
        replica.healthy = False
        log.warning(
            "%s replica %s marked unhealthy; probing it every %gs (%s)",
            self.kind,
            replica.address,
            probe_interval_s,
            self._healthy_count(),
        )
        self._health_changed()
        self._tasks.start(self._probe(replica, probe_interval_s))

    async def _probe(self, replica: Replica[StubT], interval_s: float) -> None:
        while not replica.healthy:
            await asyncio.sleep(interval_s)
            if replica.retired:
                return
            try:
                reply = await health_check(replica, timeout_s=interval_s)
                replica.healthy = reply.status == health_pb2.HealthCheckResponse.SERVING
            except grpc.aio.AioRpcError:
                continue
        log.info("%s replica %s is healthy again", self.kind, replica.address)
        self._health_changed()

    def _health_changed(self) -> None:
        if self.on_health_change is not None:
            self.on_health_change()

    async def ready(self, replica: Replica[StubT], timeout_s: float) -> None:
        """Waits until the replica says SERVING and answers Info (fetching it and its pass cost), or raises
        DownstreamUnavailableError."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            try:
                reply = await health_check(replica, timeout_s=5)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    replica.info = await replica.stub.Info(common_pb2.InfoRequest(), timeout=5)
                    replica.load = PassLoad(
                        StepCost(replica.info.step_cost_fixed_ns, replica.info.step_cost_per_token_ns)
                    )
                    return
                status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.aio.AioRpcError as error:
                status = error.code().name
            if loop.time() > deadline:
                raise DownstreamUnavailableError(
                    f"{self.kind} replica {replica.address} not ready after {timeout_s:.0f}s: {status}"
                )
            await asyncio.sleep(0.5)

    async def wait_ready(self, timeout_s: float) -> None:
        """Waits until every replica answers Info (fetching it), or raises DownstreamUnavailableError."""
        await asyncio.gather(*(self.ready(r, timeout_s) for r in self.replicas))
        log.info("%s replicas ready: %s", self.kind, ", ".join(r.address for r in self.replicas))

    async def close(self) -> None:
        await asyncio.gather(*(r.channel.close() for r in self.replicas))
