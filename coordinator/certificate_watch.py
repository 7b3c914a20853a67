"""The coordinator's client certificates for its replicas, followed while it serves: when their files change (a
renewed certificate, a CA rotation: k8s/README.md, "Certificates"), every pool reopens its channels with them."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc

from coordinator.replicas import ReplicaPool
from specdec.serving.certificate_reload import ReloadingTlsFiles

CHECK_INTERVAL_S = 10.0  # the kubelet refreshes a Secret volume within about a minute: this adds little to it


async def follow_replica_certificates(
    certificates: ReloadingTlsFiles[grpc.ChannelCredentials | None],
    pools: Sequence[ReplicaPool],
    grace_s: float,
    interval_s: float = CHECK_INTERVAL_S,
) -> None:
    """Runs until cancelled: looks at the files every interval_s; calls on the old channels get grace_s."""
    while True:
        await asyncio.sleep(interval_s)
        renewed = certificates.renewed()
        if renewed is not None:
            for pool in pools:
                pool.renew_channels(renewed, grace_s)
