"""Channel and server options shared by every gRPC endpoint (kept free of heavy imports for the client)."""

from __future__ import annotations

MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def channel_options() -> list[tuple[str, int]]:
    """Message-size limits matching the servers'."""
    return [("grpc.max_send_message_length", MAX_MESSAGE_BYTES), ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
