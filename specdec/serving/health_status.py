"""Readiness and liveness of one server, kept apart on one grpc.health.v1 servicer (k8s/README.md, "Health").

- Readiness, under the overall name "" and each API service's name: SERVING while the server can take calls
  now, its dependencies included (the coordinator's follows its verify replicas). Kubelet's readiness and
  startup probes, and the coordinator's checks of its replicas, read it.
- Liveness, under the name `liveness`: SERVING while the process serves; NOT_SERVING once it stops serving for
  good, because it shuts down or because a part of the process itself (its model process, a tensor-parallel
  rank) is gone, which only a restart mends. Kubelet's liveness probe reads it, so an outage elsewhere makes a
  pod unready but never restarts it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from grpc_health.v1 import health, health_pb2

log = logging.getLogger(__name__)

LIVENESS = "liveness"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class HealthStatus:
    """What one health servicer says: readiness ("" and the API services' names) and liveness (LIVENESS)."""

    def __init__(self, servicer: health.HealthServicer, service_names: Sequence[str]):
        self.servicer = servicer
        self.readiness_names = ("", *service_names)
        self.ended = ""  # why the process stopped serving for good ("" while it serves)

    async def set_ready(self, ready: bool) -> None:
        """Readiness follows the server's dependencies; once the process stopped serving it stays NOT_SERVING."""
        status = SERVING if ready and not self.ended else NOT_SERVING
        for name in self.readiness_names:
            await self.servicer.set(name, status)

    async def start(self) -> None:
        """The process serves: alive and ready."""
        await self.servicer.set(LIVENESS, SERVING)
        await self.set_ready(True)

    async def end(self, reason: str) -> None:
        """The process stops serving for good (shutting down, or a part of it died): every name NOT_SERVING."""
        if not self.ended:
            log.info("health: NOT_SERVING for good (%s)", reason)
        self.ended = self.ended or reason
        await self.set_ready(False)
        await self.servicer.set(LIVENESS, NOT_SERVING)
