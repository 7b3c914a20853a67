"""Preemption of running sessions when the KV cache is full: the newest give their blocks to older ones.

A round whose session cannot get the blocks it grows into would otherwise fail its request. Instead, as vLLM's
scheduler does in its recompute mode, the service frees the blocks of the sessions that arrived last (`make_room`),
newest first, until the round fits; when none newer is left, the session that cannot grow is preempted itself.
A preempted session keeps its tokens and drops its cache (`KVSession.evict`): its next call queues for blocks
ahead of new sessions (specdec/engine/kv/admission.py), then its forward feeds every token again. Rounds and draws
depend on the tokens alone, so the caller sees only the wait.

Newest first: the oldest session always finishes, so the pool drains however full it is, and the sessions preempted
have the least to recompute. Arrival is the session's open; a preempted session keeps its place.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Collection

from specdec.common.errors import SessionPreemptedError
from specdec.engine.kv.session import KVSession

log = logging.getLogger(__name__)
PreemptHook = Callable[[], None]  # hears of each session preempted (e.g. a counter)


class Preemptions:
    """Which sessions of one model service arrived in which order, which are preempted, and which of those may
    run again (readmitted). Used from the model thread, but `readmit` (the event loop, once the session's queue
    turn came)."""

    def __init__(self, on_preempt: PreemptHook | None = None):
        self.on_preempt = on_preempt
        self._arrivals = itertools.count()
        self._arrival: dict[str, int] = {}  # per open session its place in arrival order
        self._preempted: dict[str, bool] = {}  # per preempted session: whether it was readmitted

    def arrived(self, session_id: str) -> None:
        self._arrival[session_id] = next(self._arrivals)

    def left(self, session_id: str) -> None:
        self._arrival.pop(session_id, None)
        self._preempted.pop(session_id, None)

    def order(self, session_id: str) -> int:
        """The session's place in arrival order (lower: older)."""
        return self._arrival.get(session_id, -1)

    def is_preempted(self, session_id: str) -> bool:
        return session_id in self._preempted

    def check_runnable(self, session_id: str, kv: KVSession) -> None:
        """SessionPreemptedError for a preempted session not yet readmitted: its call must queue for blocks first."""
        if self._preempted.get(session_id) is False:
            raise SessionPreemptedError(session_id, len(kv))

    def readmit(self, session_id: str) -> None:
        """The session's queue turn came: its next forward may take blocks again."""
        if session_id in self._preempted:
            self._preempted[session_id] = True

    def ran(self, session_id: str) -> None:
        """The session's forward got its blocks: it runs again."""
        self._preempted.pop(session_id, None)

    def preempt(self, session_id: str, kv: KVSession) -> SessionPreemptedError:
        """Frees the session's cache, keeping its tokens; the error its call is answered with."""
        freed = kv.cached_len
        if freed:
            kv.evict()
        if self._preempted.get(session_id) is not False:
            log.info("session %r preempted (KV cache full): %d cached positions freed, to recompute", session_id, freed)
            self._preempted[session_id] = False
            if self.on_preempt is not None:
                self.on_preempt()
        return SessionPreemptedError(session_id, len(kv))

    def make_room(
        self, session_id: str, sessions: Callable[[str], KVSession | None], busy: Collection[str] = ()
    ) -> bool:
        """Preempts the newest session that arrived after `session_id`, holds blocks and is not `busy` (planned in
        the running step); False when there is none."""
        mine = self.order(session_id)
        newer = sorted((order, other) for other, order in self._arrival.items() if order > mine and other not in busy)
        for _, other in reversed(newer):
            kv = sessions(other)
            if kv is not None and kv.cached_len:
                self.preempt(other, kv)
                return True
        return False
