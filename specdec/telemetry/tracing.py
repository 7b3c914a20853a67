"""Tracer provider set-up from settings: where spans go (exporters) and how many traces are kept (sampling).

`trace_exporter` is a comma-separated list of:
  none          no spans leave the process (the default)
  console       one JSON object per span on stderr (where the logs go)
  otlp          OTLP/gRPC, configured by the standard OTEL_EXPORTER_OTLP_* environment variables
  jsonl:PATH    one line of JSON per span appended to PATH (several processes may share one file);
                `python -m specdec.telemetry.timeline` draws a request's trace from it
  memory        kept in the process (tests: `provider.memory_exporter`)
Sampling is parent-based: a span whose caller sampled its trace is recorded, one whose caller did not is
not, and a new trace is kept with probability `trace_sample_ratio`.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from collections.abc import Sequence

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

from specdec.common.settings import env_name

log = logging.getLogger(__name__)

TRACER_NAME = "specdec"
ROLE_ATTRIBUTE = "specdec.role"  # resource attribute: coordinator, draft or verify
LANE_ATTRIBUTE = "specdec.lane"  # span attribute: the service a span's time was spent in, when not its own
_configured = False


def span_to_dict(span: ReadableSpan) -> dict:
    """A span as one flat JSON-able record (ids in hex, times in ns since the epoch)."""
    parent = span.parent
    return {
        "name": span.name,
        "trace_id": format(span.context.trace_id, "032x"),
        "span_id": format(span.context.span_id, "016x"),
        "parent_span_id": format(parent.span_id, "016x") if parent is not None else None,
        "kind": span.kind.name,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name,
        "role": span.resource.attributes.get(ROLE_ATTRIBUTE, ""),
        "attributes": dict(span.attributes or {}),
        "events": [
            {"name": e.name, "time_ns": e.timestamp, "attributes": dict(e.attributes or {})} for e in span.events
        ],
    }


class JsonLinesSpanExporter(SpanExporter):
    """Appends each span as one JSON line to a file; each batch is one O_APPEND write, so processes can share it."""

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        data = "".join(json.dumps(span_to_dict(s), separators=(",", ":")) + "\n" for s in spans).encode()
        with self._lock:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


class SpecdecTracerProvider(TracerProvider):
    """The SDK provider plus the in-memory exporter when `memory` was asked for."""

    memory_exporter: InMemorySpanExporter | None = None


def build_tracer_provider(role: str, exporters: str, sample_ratio: float) -> SpecdecTracerProvider | None:
    """A provider for one service with the exporters named in `exporters`; None when that is `none` or empty."""
    if not 0.0 <= sample_ratio <= 1.0:
        raise ValueError(f"trace_sample_ratio must be in [0, 1], got {sample_ratio}")
    names = [n.strip() for n in exporters.split(",") if n.strip() and n.strip() != "none"]
    if not names:
        return None
    provider = SpecdecTracerProvider(
        resource=Resource.create({"service.name": f"specdec-{role}", ROLE_ATTRIBUTE: role}),
        sampler=ParentBased(TraceIdRatioBased(sample_ratio)),
    )
    for name in names:
        if name == "console":
            provider.add_span_processor(
                SimpleSpanProcessor(
                    ConsoleSpanExporter(out=sys.stderr, formatter=lambda s: json.dumps(span_to_dict(s)) + "\n")
                )
            )
        elif name == "otlp":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        elif name.startswith("jsonl:") and len(name) > len("jsonl:"):
            # Synchronous, so a span is in the file by the time the call that ended it returns.
            provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(name.removeprefix("jsonl:"))))
        elif name == "memory":
            provider.memory_exporter = InMemorySpanExporter()
            provider.add_span_processor(SimpleSpanProcessor(provider.memory_exporter))
        else:
            raise ValueError(
                f"trace_exporter: unknown exporter {name!r} "
                "(use none, console, otlp, jsonl:PATH or memory, comma-separated)"
            )
    return provider


def setup_tracing(role: str, exporters: str, sample_ratio: float) -> SpecdecTracerProvider | None:
    """Installs the process-wide tracer provider for one service (once; later calls change nothing)."""
    global _configured
    if _configured:
        return None
    _configured = True
    provider = build_tracer_provider(role, exporters, sample_ratio)
    if provider is not None:
        trace.set_tracer_provider(provider)
        log.info("tracing: %s exporters %s, sample ratio %g", role, exporters, sample_ratio)
    return provider


def setup_tracing_from_env(role: str) -> None:
    """For a service that has not called setup_tracing: the same settings, read from SPECDEC_TRACE_* variables."""
    if not _configured:
        setup_tracing(
            role,
            os.environ.get(env_name("trace_exporter"), "none"),
            float(os.environ.get(env_name("trace_sample_ratio"), "1.0")),
        )
