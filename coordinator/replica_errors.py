"""What a replica's error status means for the client: the coordinator, not the client, built the call.

A replica's status is passed on only where it is the client's doing; otherwise it is mapped to the party it
blames, with the replica named:

| replica's status | client gets | why |
| --- | --- | --- |
| UNAVAILABLE, DEADLINE_EXCEEDED | UNAVAILABLE | the replica is gone or slow (ReplicaUnreachableError) |
| NOT_FOUND | UNAVAILABLE "... lost session ...; retry" | it restarted or expired the session; a retry opens anew |
| RESOURCE_EXHAUSTED | RESOURCE_EXHAUSTED | the replica is full (its --max-sessions, its KV cache budget, its context) |
| INVALID_ARGUMENT on a field the client chose (`draft_method`) | INVALID_ARGUMENT naming it | the request |
| INVALID_ARGUMENT otherwise, FAILED_PRECONDITION, anything else | INTERNAL with the replica's detail | the stack |

A drafter's errors other than the client's own never reach the client: the request carries on by plain decoding
(coordinator/replica_sessions.py).
"""

from __future__ import annotations

import grpc

from specdec.common.errors import (
    CapacityError,
    DownstreamUnavailableError,
    InvalidFieldError,
    ReplicaFaultError,
    ReplicaUnreachableError,
)

# Fields of a replica call that carry the client's own choice, so the replica's refusal is the client's to fix.
CLIENT_FIELDS = frozenset({"draft_method"})


def replica_error(
    kind: str, address: str, method: str, session_id: str, error: grpc.aio.AioRpcError
) -> DownstreamUnavailableError | CapacityError | InvalidFieldError | ReplicaFaultError:
    """The error to raise for a `kind` ("draft", "verify") replica's failed `method` call on `session_id`."""
    code, details = error.code(), error.details() or ""
    where = f"{kind} replica {address}"
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return ReplicaUnreachableError(f"{where} {method}: {code.name}: {details}", address)
    if code == grpc.StatusCode.NOT_FOUND:
        return DownstreamUnavailableError(f"{where} lost session {session_id!r} ({method}: {details}); retry")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return CapacityError(f"{where}: {details}")
    field, _, problem = details.partition(": ")
    if code == grpc.StatusCode.INVALID_ARGUMENT and field in CLIENT_FIELDS:
        return InvalidFieldError(field, f"{problem} ({where})")
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return ReplicaFaultError(f"{where} {method}: out of sync with the coordinator: {details}")
    return ReplicaFaultError(f"{where} refused {method}: {code.name}: {details}")
