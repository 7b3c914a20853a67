"""Tracer provider set-up: exporters from the setting, parent-based sampling, the JSONL span file."""

from __future__ import annotations

import json

import pytest
from opentelemetry import trace

from specdec.telemetry.tracing import build_tracer_provider


def test_none_builds_no_provider():
    assert build_tracer_provider("draft", "none", 1.0) is None
    assert build_tracer_provider("draft", "", 1.0) is None


@pytest.mark.parametrize("exporters, ratio", [("zipkin", 1.0), ("jsonl:", 1.0), ("memory", 1.5), ("memory", -0.1)])
def test_bad_settings_are_refused(exporters, ratio):
    with pytest.raises(ValueError):
        build_tracer_provider("draft", exporters, ratio)


def test_sampling_ratio_applies_to_new_traces_and_callers_decide_for_theirs():
    provider = build_tracer_provider("verify", "memory", 0.0)
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("root") as root:
        assert not root.is_recording()
    sampled_parent = trace.set_span_in_context(
        trace.NonRecordingSpan(
            trace.SpanContext(
                trace_id=0x1234, span_id=0x99, is_remote=True, trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED)
            )
        )
    )
    with tracer.start_as_current_span("child", context=sampled_parent) as child:
        assert child.is_recording()
    assert [s.name for s in provider.memory_exporter.get_finished_spans()] == ["child"]


def test_jsonl_exporter_appends_one_record_per_span_with_role_and_parent(tmp_path):
    path = tmp_path / "spans.jsonl"
    for role in ("coordinator", "draft"):  # two processes sharing one file
        provider = build_tracer_provider(role, f"jsonl:{path},memory", 1.0)
        tracer = provider.get_tracer("test")
        with tracer.start_as_current_span("outer"):
            with tracer.start_as_current_span("inner", attributes={"specdec.base_len": 3}):
                pass
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["role"], r["name"]) for r in records] == [
        ("coordinator", "inner"),
        ("coordinator", "outer"),
        ("draft", "inner"),
        ("draft", "outer"),
    ]
    inner, outer = records[0], records[1]
    assert inner["parent_span_id"] == outer["span_id"] and outer["parent_span_id"] is None
    assert inner["trace_id"] == outer["trace_id"] and len(inner["trace_id"]) == 32
    assert inner["attributes"] == {"specdec.base_len": 3}
    assert outer["start_ns"] <= inner["start_ns"] <= inner["end_ns"] <= outer["end_ns"]
