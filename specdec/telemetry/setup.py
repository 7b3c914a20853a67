"""The one call each service makes at start-up: tracing from its settings, /metrics, session gauges."""

from __future__ import annotations

from typing import Protocol

from specdec.engine.kv.blocks import BlockAllocator
from specdec.telemetry.metrics import kv_block_gauges, serve_metrics, session_gauges
from specdec.telemetry.tracing import setup_tracing


class TelemetrySettings(Protocol):
    """The settings fields telemetry reads (every service's settings has them)."""

    trace_exporter: str
    trace_sample_ratio: float
    metrics_port: int


class SessionCounts(Protocol):
    """What the session gauges read: specdec.serving.session_store.SessionStore."""

    def __len__(self) -> int: ...

    def kv_cache_tokens(self) -> int: ...


def start_telemetry(
    role: str,
    settings: TelemetrySettings,
    sessions: SessionCounts | None = None,
    kv_blocks: BlockAllocator | None = None,
) -> None:
    """Installs tracing (role: coordinator, draft or verify), serves /metrics on settings.metrics_port
    (0 = off) and, given the service's SessionStore, exports active sessions and KV-cache tokens, and given its
    model's paged KV pool's blocks, their counts."""
    setup_tracing(role, settings.trace_exporter, settings.trace_sample_ratio)
    if sessions is not None:
        session_gauges(lambda: len(sessions), sessions.kv_cache_tokens)
    if kv_blocks is not None:
        kv_block_gauges(kv_blocks)
    serve_metrics(settings.metrics_port)
