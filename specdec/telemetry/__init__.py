"""Tracing (OpenTelemetry) and metrics (Prometheus) shared by the coordinator, draft and verify services.

A service calls `start_telemetry(role, settings, sessions)` once at start-up; specdec.serving.server.start_server
installs the gRPC server interceptor (specdec/serving/grpc_telemetry.py) that joins incoming traces and counts
RPCs. Imports `common` and `engine` (the KV blocks it counts), never `serving`.
"""

from specdec.telemetry.setup import start_telemetry

__all__ = ["start_telemetry"]
