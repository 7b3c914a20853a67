"""Domain errors the services raise; `specdec.serving.grpc_errors` maps each to one gRPC status in one place."""

from __future__ import annotations


class SpecDecError(Exception):
    """Base of the errors that carry a client-meaningful status."""


class InvalidFieldError(SpecDecError, ValueError):
    """A request field is out of range or malformed (INVALID_ARGUMENT). The message names the field."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field = field


class SessionNotFoundError(SpecDecError, KeyError):
    """No session with that id on this replica (NOT_FOUND)."""

    def __init__(self, session_id: str):
        super().__init__(f"session_id: no session {session_id!r} on this replica")
        self.session_id = session_id

    def __str__(self) -> str:
        return self.args[0]


class SessionExistsError(SpecDecError):
    """A session with that id is already open (ALREADY_EXISTS)."""


class CapacityError(SpecDecError):
    """A limit was reached: sessions, context, rate (RESOURCE_EXHAUSTED)."""


class KVCacheFullError(CapacityError):
    """The KV cache's budget has too few free blocks for a session to open or grow (RESOURCE_EXHAUSTED). The
    message says what was asked and what is free."""


class SessionPreemptedError(KVCacheFullError):
    """A session gave its KV blocks to older ones (specdec/engine/kv/preemption.py): its call queues for blocks and
    runs again, recomputing the session. Handled inside the service; RESOURCE_EXHAUSTED should one ever escape."""

    def __init__(self, session_id: str, tokens: int):
        super().__init__(f"KV cache full: session {session_id!r} ({tokens} tokens) was preempted")
        self.session_id = session_id
        self.tokens = tokens


class StaleBaseLenError(SpecDecError):
    """The caller's base_len is past what this replica holds (FAILED_PRECONDITION); carries our length."""

    def __init__(self, session_id: str, base_len: int, session_len: int):
        super().__init__(f"base_len: {base_len} is past session {session_id!r}'s length {session_len}")
        self.session_len = session_len


class DownstreamUnavailableError(SpecDecError):
    """A draft or verify replica needed for the request is gone (UNAVAILABLE)."""


class ReplicaUnreachableError(DownstreamUnavailableError):
    """A replica did not answer a call: gone, or past the call's deadline (UNAVAILABLE). Carries its address."""

    def __init__(self, message: str, address: str):
        super().__init__(message)
        self.address = address


class ReplicaFaultError(SpecDecError):
    """A replica refused a call the coordinator built (out of sync, or a limit or setting the two disagree on):
    not the client's doing (INTERNAL). The message names the replica and carries its answer."""


class UnauthenticatedError(SpecDecError):
    """Missing or wrong credentials (UNAUTHENTICATED)."""


class RequestInProgressError(SpecDecError):
    """The request id is being run by another coordinator, or this one lost it to another (ABORTED)."""
