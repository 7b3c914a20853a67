"""The sessions one replica holds, keyed by id, with a cap on how many may be open."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, Protocol, TypeVar

from specdec.errors import CapacityError, SessionExistsError, SessionNotFoundError


class Sized(Protocol):
    def __len__(self) -> int: ...


SessionT = TypeVar("SessionT", bound=Sized)


class SessionStore(Generic[SessionT]):
    """Open sessions by id; opening past `max_sessions` raises CapacityError."""

    def __init__(self, max_sessions: int, kv_tokens: Callable[[SessionT], int]):
        self.max_sessions = max_sessions
        self._kv_tokens = kv_tokens
        self._sessions: dict[str, SessionT] = {}

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

    def get(self, session_id: str) -> SessionT:
        try:
            return self._sessions[session_id]
        except KeyError:
            raise SessionNotFoundError(session_id) from None

    def close(self, session_id: str) -> bool:
        """Drops a session; False when it was not open."""
        return self._sessions.pop(session_id, None) is not None

    def kv_cache_tokens(self) -> int:
        """Tokens held in KV caches over all open sessions (safe to call from another thread: /metrics)."""
        return sum(self._kv_tokens(s) for s in list(self._sessions.values()))
