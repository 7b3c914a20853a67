"""A CloseSession that failed is tried once more in the background, so a transient failure leaks no session.

If the second try fails too, the replica's own idle expiry (--session-idle-ttl-s) frees the session later.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from coordinator.background_tasks import BackgroundTasks
from coordinator.replicas import Replica
from specdec.v1 import common_pb2

log = logging.getLogger(__name__)
CLOSE_RETRY_DELAY_S = 1.0  # a replica that was only slow or restarting gets this long before the second try
_retries = BackgroundTasks()  # retries in flight


def retry_close_later(
    replica: Replica, session_id: str, timeout_s: float, delay_s: float | None = None
) -> asyncio.Future:
    """Closes `session_id` on `replica` once more after delay_s (default CLOSE_RETRY_DELAY_S), logging the outcome
    (also the first close of a session left behind on a replica it moved off: coordinator/session_moves.py)."""

    async def retry() -> None:
        await asyncio.sleep(CLOSE_RETRY_DELAY_S if delay_s is None else delay_s)
        try:
            await replica.stub.CloseSession(common_pb2.CloseSessionRequest(session_id=session_id), timeout=timeout_s)
        except grpc.aio.AioRpcError as error:
            log.warning(
                "session %s: closing it on %s in the background failed (%s: %s); the replica's --session-idle-ttl-s "
                "frees it",
                session_id,
                replica.address,
                error.code().name,
                error.details(),
            )
        else:
            log.info("session %s: closed on %s in the background", session_id, replica.address)
        finally:
            replica.pending_closes -= 1
            if replica.unused:  # it left placement meanwhile: this retry was the last user of its channel
                await replica.channel.close()

    replica.pending_closes += 1
    return _retries.start(retry())
