"""Draws one request's trace as a PNG timeline with a lane per service (coordinator, draft, verify).

    python -m specdec.telemetry.timeline --spans spans.jsonl --out timeline.png [--request-id ID | --trace-id HEX]

`spans.jsonl` is what the services write with `--trace-exporter jsonl:spans.jsonl` (or the env variable
SPECDEC_TRACE_EXPORTER); several services may append to one file. Without --request-id/--trace-id the
last request in the file is drawn. A span is drawn in the lane of the service that recorded it, or of
the one named by its `specdec.lane` attribute (service-side stages the coordinator lays out from the
durations the services report). Within a lane, rows follow nesting depth; overlapping spans (a pre-draft
running beside a verification) get rows of their own.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from specdec.telemetry.tracing import LANE_ATTRIBUTE

LANES = ("coordinator", "draft", "verify")
COLORS = {  # by span name; server spans and anything else fall back to grey
    "generate": "#d9d9d9",
    "round": "#c6dbef",
    "open_sessions": "#e5d8bd",
    "open_draft_session": "#e5d8bd",
    "close_sessions": "#e5d8bd",
    "draft.propose": "#9ecae1",
    "verify": "#fdae6b",
    "commit": "#74c476",
    "wire": "#bdbdbd",
    "draft.forward": "#3182bd",
    "verify.forward": "#e6550d",
    "verify.sampling": "#a63603",
    "draft.prefill": "#8c6d31",
    "verify.prefill": "#8c6d31",
    "draft.open_session": "#e7cb94",
    "verify.open_session": "#e7cb94",
    "draft.close_session": "#e7cb94",
    "verify.close_session": "#e7cb94",
}
SERVER_COLOR = "#efefef"


@dataclass
class SpanRecord:
    """One span of the JSONL file, with the lane and row it is drawn in."""

    name: str
    span_id: str
    parent_span_id: str | None
    start_ns: int
    end_ns: int
    lane: str
    kind: str
    attributes: dict
    depth: int = 0
    row: int = 0


def read_spans(paths: Iterable[pathlib.Path]) -> list[dict]:
    spans = []
    for path in paths:
        for line in path.read_text().splitlines():
            if line.strip():
                spans.append(json.loads(line))
    return spans


def select_trace(spans: Sequence[dict], request_id: str | None = None, trace_id: str | None = None) -> list[dict]:
    """The spans of one trace: by trace id, by request id (the client's, on the Coordinator's server span, or the
    coordinator's, on the `generate` span), or the last request's."""
    if trace_id is None:
        requests = (
            [s for s in spans if s["name"] == "generate"]
            if request_id is None
            else [s for s in spans if s["attributes"].get("specdec.request_id") == request_id]
        )
        if not requests:
            raise SystemExit(f"no request {request_id!r} in the spans" if request_id else "no request in the spans")
        trace_id = max(requests, key=lambda s: s["start_ns"])["trace_id"]
    chosen = [s for s in spans if s["trace_id"] == trace_id]
    if not chosen:
        raise SystemExit(f"no spans of trace {trace_id}")
    return chosen


def layout(spans: Sequence[dict]) -> list[SpanRecord]:
    """Lanes, nesting depths and rows (greedy: the first row of the span's band, depth and server or not,
    that it does not overlap)."""
    records = {
        s["span_id"]: SpanRecord(
            s["name"],
            s["span_id"],
            s["parent_span_id"],
            s["start_ns"],
            s["end_ns"],
            s["attributes"].get(LANE_ATTRIBUTE) or s.get("role") or "coordinator",
            s["kind"],
            s["attributes"],
        )
        for s in spans
    }
    for record in records.values():
        depth, parent = 0, records.get(record.parent_span_id)
        while parent is not None and depth < 64:
            depth += 1
            parent = records.get(parent.parent_span_id)
        record.depth = depth
    rows_in_use: dict[str, list[tuple[tuple, int]]] = defaultdict(list)  # lane -> [(band, end_ns)] per row
    band = lambda r: (r.depth, r.kind != "SERVER")  # noqa: E731 - a service's own spans above the stages
    for record in sorted(records.values(), key=lambda r: (band(r), r.start_ns)):
        rows = rows_in_use[record.lane]
        for index, (row_band, end_ns) in enumerate(rows):
            if row_band == band(record) and end_ns <= record.start_ns:
                rows[index] = (row_band, record.end_ns)
                record.row = index
                break
        else:
            rows.append((band(record), record.end_ns))
            record.row = len(rows) - 1
    return list(records.values())


def _label(record: SpanRecord) -> str:
    if record.name == "round":
        return f"round {record.attributes.get('specdec.round', '')}"
    if record.name == "draft.propose" and record.attributes.get("specdec.predraft"):
        return "pre-draft"
    if record.kind == "SERVER":
        return record.name.rpartition("/")[2]
    return record.name


def draw(spans: Sequence[dict], out: pathlib.Path, title: str = "") -> None:
    """Renders the spans of one trace to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    records = layout(spans)
    origin = min(r.start_ns for r in records)
    lanes = [lane for lane in LANES if any(r.lane == lane for r in records)]
    lanes += sorted({r.lane for r in records} - set(lanes))
    rows_per_lane = {lane: 1 + max(r.row for r in records if r.lane == lane) for lane in lanes}
    offsets, y = {}, 0
    for lane in lanes:
        offsets[lane] = y
        y += rows_per_lane[lane] + 1  # a blank row between lanes
    total_ms = (max(r.end_ns for r in records) - origin) / 1e6
    fig, ax = plt.subplots(figsize=(16, 0.32 * y + 1.8))
    for record in records:
        start_ms, width_ms = (record.start_ns - origin) / 1e6, max((record.end_ns - record.start_ns) / 1e6, 1e-3)
        row = offsets[record.lane] + record.row
        color = SERVER_COLOR if record.kind == "SERVER" else COLORS.get(record.name, "#dadaeb")
        ax.barh(
            row,
            width_ms,
            left=start_ms,
            height=0.8,
            color=color,
            edgecolor="#555555",
            linewidth=0.4,
            hatch="//" if record.name == "wire" else None,
        )
        label = _label(record)
        if width_ms > total_ms * 0.008 * len(label):
            ax.text(start_ms + width_ms / 2, row, label, ha="center", va="center", fontsize=6, clip_on=True)
    ax.set_yticks([offsets[lane] + (rows_per_lane[lane] - 1) / 2 for lane in lanes], lanes)
    for lane in lanes[1:]:
        ax.axhline(offsets[lane] - 1, color="#999999", linewidth=0.6)
    ax.set_ylim(y - 1, -1)
    ax.set_xlim(0, total_ms * 1.01)
    ax.set_xlabel("ms since the request arrived")
    ax.set_title(title, fontsize=9)
    legend = [
        "round",
        "draft.propose",
        "draft.forward",
        "verify",
        "verify.forward",
        "verify.sampling",
        "commit",
        "wire",
        "draft.prefill",
    ]
    handles = [
        Patch(
            facecolor=COLORS[n],
            edgecolor="#555555",
            hatch="//" if n == "wire" else None,
            label="prefill" if n == "draft.prefill" else n,
        )
        for n in legend
    ]
    handles.append(Patch(facecolor=SERVER_COLOR, edgecolor="#555555", label="gRPC server span"))
    ax.legend(
        handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=len(handles), fontsize=7, frameon=False
    )
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    plt.close(fig)


def describe(spans: Sequence[dict]) -> str:
    """A title line from the request span's attributes."""
    request = next((s for s in spans if s["name"] == "generate"), None)
    if request is None:
        return f"trace {spans[0]['trace_id']}"
    a = request["attributes"]
    rounds, drafted, accepted = (
        a.get("specdec.rounds", 0),
        a.get("specdec.drafted_tokens", 0),
        a.get("specdec.accepted_tokens", 0),
    )
    alpha = f", α={accepted / drafted:.2f}" if drafted else ""
    return (
        f"request {a.get('specdec.request_id', '')}: {a.get('specdec.prompt_tokens', 0)} prompt + "
        f"{a.get('specdec.generated_tokens', 0)} generated tokens, γ={a.get('specdec.num_speculative_tokens')}, "
        f"{rounds} rounds{alpha}, overlap={a.get('specdec.overlap')}, "
        f"{(request['end_ns'] - request['start_ns']) / 1e6:.1f} ms (trace {request['trace_id']})"
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Draw one request's trace as a PNG timeline.")
    parser.add_argument("--spans", type=pathlib.Path, nargs="+", required=True, help="JSONL span file(s)")
    parser.add_argument("--out", type=pathlib.Path, required=True, help="PNG to write")
    parser.add_argument("--request-id", help="the request to draw (default: the last one)")
    parser.add_argument("--trace-id", help="the trace to draw (32 hex digits)")
    args = parser.parse_args(argv)
    spans = select_trace(read_spans(args.spans), args.request_id, args.trace_id)
    draw(spans, args.out, describe(spans))
    print(f"{len(spans)} spans -> {args.out}")


if __name__ == "__main__":
    main(sys.argv[1:])
