"""Tracing (OpenTelemetry) and metrics (Prometheus) shared by the coordinator, draft and verify services.

A service calls `start_telemetry(role, settings, sessions)` once at start-up; specdec.serving.start_server
installs the gRPC server interceptor that joins incoming traces and counts RPCs.
"""

from specdec.telemetry.setup import start_telemetry

__all__ = ["start_telemetry"]
