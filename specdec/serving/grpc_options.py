"""Channel and server options shared by every gRPC endpoint (kept free of heavy imports for the client)."""

from __future__ import annotations

MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def channel_options() -> list[tuple[str, int]]:
    """Message-size limits matching the servers'."""
    return [("grpc.max_send_message_length", MAX_MESSAGE_BYTES), ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]


def connection_age_options(max_age_s: float, grace_s: float) -> list[tuple[str, int]]:
    """Server options that close each client connection after max_age_s (GOAWAY; the client reconnects, resolving
    the name again), leaving its calls grace_s to finish; none when max_age_s is 0."""
    if max_age_s < 0 or grace_s < 0:
        raise ValueError(
            f"max_connection_age_s and max_connection_age_grace_s must be >= 0, got {max_age_s}, {grace_s}"
        )
    if not max_age_s:
        return []
    return [
        ("grpc.max_connection_age_ms", int(max_age_s * 1000)),
        ("grpc.max_connection_age_grace_ms", int(grace_s * 1000)),
    ]
