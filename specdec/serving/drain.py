"""A model service's graceful drain: on SIGTERM it opens no more sessions and serves the ones it holds until their
callers have moved or closed them, or the grace period ends.

Stopping the gRPC server at once would fail every session's next round. Instead (specdec/serving/server.py):
- readiness turns NOT_SERVING (liveness stays SERVING: the process still serves), so placement and readiness
  probes send nothing new;
- OpenSession answers UNAVAILABLE ("draining"), and every reply on a session says `draining`, so coordinators move
  their sessions to another replica between two rounds (coordinator/session_moves.py);
- the process exits once no session is left, or after `--grace-s`, whichever comes first.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sized

from specdec.common.errors import DownstreamUnavailableError

log = logging.getLogger(__name__)
POLL_S = 0.05  # how often a drain looks whether sessions are left


class SessionDrain:
    """Whether a model service drains, and the wait for its sessions to go."""

    def __init__(self, sessions: Sized):
        self.sessions = sessions
        self.draining = False

    def refuse_if_draining(self) -> None:
        """DownstreamUnavailableError (UNAVAILABLE) for a new session while draining."""
        if self.draining:
            raise DownstreamUnavailableError("draining: this replica opens no new sessions; open it on another")

    async def drain(self, grace_s: float) -> None:
        """Starts draining and waits until no session is left or grace_s has passed."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        log.info("draining: %d sessions; waiting up to %.0fs for callers to move them", len(self.sessions), grace_s)
        while len(self.sessions) and loop.time() < deadline:
            await asyncio.sleep(POLL_S)
        if len(self.sessions):
            log.warning("draining: grace period over with %d sessions left", len(self.sessions))
        else:
            log.info("draining: no session left")
