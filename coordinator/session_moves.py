"""Moving one request's session to another replica, with every committed token, when its own fails or drains.

The coordinator holds what a session holds: the prompt and the committed tokens (the sync invariant). So a session
can open anew on another replica (one prefill) and the request goes on there:
- a verify session moves when a call finds its replica gone or past its deadline (UNAVAILABLE, DEADLINE_EXCEEDED),
  when the replica lost it (NOT_FOUND: it restarted), and between two rounds when a reply says the replica drains;
- a draft session moves when its drafter fails or drains; the request decodes plainly while it moves.
What follows does not change: greedy tokens are a function of the committed ones, and seeded draws of (seed,
position) (docs/architecture.md "Failure handling"). A request moves at most `--max-session-moves` times per kind;
the replica left behind gets its session closed in the background.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from coordinator.close_retry import retry_close_later
from coordinator.replicas import Replica, ReplicaPool
from coordinator.request_stats import RequestStats
from specdec.common.errors import DownstreamUnavailableError, ReplicaUnreachableError
from specdec.telemetry.metrics import SpeculationMetrics

log = logging.getLogger(__name__)
UNAVAILABLE, LOST_SESSION, DRAINING, FAILED = "unavailable", "lost_session", "draining", "failed"  # why a move
OUT_OF_PLACEMENT = (UNAVAILABLE, DRAINING)  # reasons that take the replica left behind out of placement


def unavailable_reason(error: DownstreamUnavailableError) -> str:
    """UNAVAILABLE for a replica gone or past its deadline, LOST_SESSION for one that no longer holds the session."""
    return UNAVAILABLE if isinstance(error, ReplicaUnreachableError) else LOST_SESSION


@dataclass(frozen=True)
class Placement:
    """The pools a request's sessions may move within, and how often per kind."""

    draft_pool: ReplicaPool
    verify_pool: ReplicaPool
    max_moves: int


class SessionMoves:
    """One request's moves: picks the next replica, opens the session there, hands the old one back."""

    def __init__(
        self, placement: Placement, session_id: str, timeout_s: float, stats: RequestStats, metrics: SpeculationMetrics
    ):
        self.placement = placement
        self.session_id = session_id
        self.timeout_s = timeout_s
        self.stats = stats
        self.metrics = metrics
        self.moves = {"draft": 0, "verify": 0}

    def pool(self, kind: str) -> ReplicaPool:
        return self.placement.verify_pool if kind == "verify" else self.placement.draft_pool

    async def move(
        self, kind: str, leaving: Replica, reason: str, open_on: Callable[[Replica], Awaitable[None]]
    ) -> Replica | None:
        """Opens the session on the least-loaded other replica of the kind (`open_on`; healthy ones first), trying
        the next while they turn out gone; then hands `leaving` back and closes the session there in the background.
        The replica it moved to, or None when no replica could take it or the request moved too often."""
        pool = self.pool(kind)
        if reason in OUT_OF_PLACEMENT:
            pool.mark_unhealthy(leaving)
        if self.moves[kind] >= self.placement.max_moves:
            log.warning(
                "request %s: not moving its %s session again (%d moves)", self.session_id, kind, self.moves[kind]
            )
            return None
        tried = [leaving]
        while (candidate := pool.acquire_instead(tried)) is not None:
            try:
                await open_on(candidate)
            except ReplicaUnreachableError:
                pool.mark_unhealthy(candidate)  # gone too: try the next
                pool.release(candidate)
                tried.append(candidate)
                continue
            except BaseException:  # refused (full), or the request ended meanwhile: an open may still land there
                pool.release(candidate)
                retry_close_later(candidate, self.session_id, self.timeout_s)
                raise
            self._moved(kind, leaving, candidate, reason)
            return candidate
        log.warning("request %s: no other healthy %s replica to move its session to", self.session_id, kind)
        return None

    def _moved(self, kind: str, leaving: Replica, arrived: Replica, reason: str) -> None:
        self.moves[kind] += 1
        setattr(self.stats, f"{kind}_moves", getattr(self.stats, f"{kind}_moves") + 1)
        self.metrics.session_moves.labels(kind, reason).inc()
        log.info(
            "request %s: moved its %s session from %s to %s (%s)",
            self.session_id,
            kind,
            leaving.address,
            arrived.address,
            reason,
        )
        if reason != LOST_SESSION:  # a replica that lost the session holds nothing to close
            retry_close_later(leaving, self.session_id, self.timeout_s, delay_s=0.0)
        self.pool(kind).release(leaving)


async def settle(task: asyncio.Future | None) -> None:
    """Cancels a move still running and waits for it to end (it hands back what it took)."""
    if task is not None and not task.done():
        task.cancel()
    if task is not None:
        await asyncio.gather(task, return_exceptions=True)
