"""The sessions one replica holds, keyed by id, with a cap on how many may be open."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from specdec.common.errors import CapacityError, SessionExistsError, SessionNotFoundError
from specdec.common.settings import setting

log = logging.getLogger(__name__)


class Sized(Protocol):
    def __len__(self) -> int: ...


SessionT = TypeVar("SessionT", bound=Sized)


@dataclass(frozen=True)
class SessionExpirySettings:
    """The session-expiry part of a model service's settings (a base of each one's settings class)."""

    session_idle_ttl_s: float = setting(
        600.0,
        "close a session no call has touched for this long, freeing its KV cache, e.g. one whose "
        "coordinator died or whose close failed (checked by a background sweep; 0 = never)",
    )


class SessionStore(Generic[SessionT]):
    """Open sessions by id; opening past `max_sessions` raises CapacityError. Remembers when a call last touched
    each session (`get`), for expiring idle ones. Closing a session releases its KV cache there and then: a paged
    cache's blocks must not wait for the garbage collector (an error's traceback may hold the session)."""

    def __init__(
        self,
        max_sessions: int,
        kv_tokens: Callable[[SessionT], int],
        release: Callable[[SessionT], None] | None = None,
    ):
        self.max_sessions = max_sessions
        self._kv_tokens = kv_tokens
        self._release = release  # gives a closed session's KV cache back at once (not when it is garbage)
        self._sessions: dict[str, SessionT] = {}
        self._touched: dict[str, float] = {}  # per session the time.monotonic() of the last call on it

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._sessions))

    def reserve(self, session_id: str) -> None:
        """Checks an id can be opened now (call before the expensive prefill)."""
        if not session_id:
            raise SessionNotFoundError(session_id)
        if session_id in self._sessions:
            raise SessionExistsError(f"session_id: {session_id!r} is already open on this replica")
        if len(self._sessions) >= self.max_sessions:
            raise CapacityError(f"this replica holds its maximum of {self.max_sessions} sessions")

    def add(self, session_id: str, session: SessionT) -> None:
        self.reserve(session_id)
        self._sessions[session_id] = session
        self._touched[session_id] = time.monotonic()

    def get(self, session_id: str) -> SessionT:
        """The session, marked as touched now."""
        try:
            session = self._sessions[session_id]
        except KeyError:
            raise SessionNotFoundError(session_id) from None
        self._touched[session_id] = time.monotonic()
        return session

    def peek(self, session_id: str) -> SessionT | None:
        """The session, or None; not marked as touched (a look by the service itself, not a call on it)."""
        return self._sessions.get(session_id)

    def close(self, session_id: str) -> bool:
        """Drops a session, releasing its KV cache; False when it was not open."""
        self._touched.pop(session_id, None)
        session = self._sessions.pop(session_id, None)
        if session is not None and self._release is not None:
            self._release(session)
        return session is not None

    def idle(self, ttl_s: float) -> list[tuple[str, float]]:
        """(session id, seconds since a call last touched it) of the sessions untouched for ttl_s or longer."""
        now = time.monotonic()
        return [(session_id, now - at) for session_id, at in list(self._touched.items()) if now - at >= ttl_s]

    def session_kv_tokens(self, session_id: str) -> int:
        session = self._sessions.get(session_id)
        return self._kv_tokens(session) if session is not None else 0

    def kv_cache_tokens(self) -> int:
        """Tokens held in KV caches over all open sessions (safe to call from another thread: /metrics)."""
        return sum(self._kv_tokens(s) for s in list(self._sessions.values()))


def close_idle_sessions(store: SessionStore, ttl_s: float, close: Callable[[str], object]) -> int:
    """Closes (by `close`, the service's own, which frees the KV cache) every session untouched for ttl_s, logging
    each; returns how many. Runs on the model thread, between steps."""
    expired = store.idle(ttl_s)
    for session_id, idle_s in expired:
        kv_tokens = store.session_kv_tokens(session_id)
        close(session_id)
        log.warning(
            "session %r expired: no call for %.1fs (session_idle_ttl_s %g); closed, %d KV tokens freed",
            session_id,
            idle_s,
            ttl_s,
            kv_tokens,
        )
    return len(expired)


async def expire_idle_sessions(
    store: SessionStore, ttl_s: float, close: Callable[[str], object], run: Callable[..., Awaitable]
) -> None:
    """Background sweep: every ttl_s / 4 (at most 30 s) closes the sessions untouched for ttl_s, by
    close_idle_sessions queued as a one-off call on the model thread (`run`, e.g. StepBatcher.run). 0: never."""
    if ttl_s <= 0:
        return
    interval_s = min(max(ttl_s / 4, 0.05), 30.0)
    while True:
        await asyncio.sleep(interval_s)
        try:
            await run(close_idle_sessions, store, ttl_s, close)
        except Exception:  # noqa: BLE001 - the sweep goes on
            log.exception("expiring idle sessions failed")
