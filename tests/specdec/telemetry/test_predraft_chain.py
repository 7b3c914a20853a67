"""The pre-draft chain report: each round's links from hand-made spans, and the command on a spans file."""

from __future__ import annotations

import json

import pytest

from specdec.telemetry.predraft_chain import chain_times, main

MS = 1_000_000


def span(trace: str, span_id: str, parent: str | None, name: str, start_ms: float, end_ms: float, **attributes):
    return {
        "name": name,
        "trace_id": trace,
        "span_id": span_id,
        "parent_span_id": parent,
        "kind": "INTERNAL",
        "start_ns": int(start_ms * MS),
        "end_ns": int(end_ms * MS),
        "status": "UNSET",
        "role": "coordinator",
        "attributes": {f"specdec.{key}": value for key, value in attributes.items()},
        "events": [],
    }


def request(trace: str, offset_ms: float) -> list[dict]:
    """Round 0 gets its verdict at 100 ms; round 1 pre-drafts 105-160 and hands the result over at 162, 88 ms
    before its own verdict; round 2 pre-drafts 260-330 and hands over at 335, 15 ms after its verdict; round 3
    pre-drafts nothing (no VerifyNext)."""
    t = offset_ms
    return [
        span(trace, "r0", None, "round", t + 0, t + 101),
        span(trace, "v0", "r0", "verify", t + 10, t + 100),
        span(trace, "r1", None, "round", t + 101, t + 251),
        span(trace, "p1", "r1", "draft.propose", t + 105, t + 160, predraft=True),
        span(trace, "n1", "r1", "verify_next", t + 162, t + 400),
        span(trace, "v1", "r1", "verify", t + 102, t + 250),
        span(trace, "r2", None, "round", t + 251, t + 321),
        span(trace, "f2", "r2", "draft.propose", t + 252, t + 254, predraft=False),  # not a pre-draft
        span(trace, "p2", "r2", "draft.propose", t + 260, t + 330, predraft=True),
        span(trace, "n2", "r2", "verify_next", t + 335, t + 500),
        span(trace, "v2", "r2", "verify", t + 255, t + 320),
        span(trace, "r3", None, "round", t + 321, t + 400),
        span(trace, "v3", "r3", "verify", t + 322, t + 390),
    ]


def test_each_chained_round_is_split_into_its_links_and_late_successors_are_counted():
    times = chain_times(request("a", 0) + request("b", 1000))
    assert times.rounds == 4
    assert times.links["to_propose"] == pytest.approx([5, 10, 5, 10])
    assert times.links["propose"] == pytest.approx([55, 70, 55, 70])
    assert times.links["to_verify_next"] == pytest.approx([2, 5, 2, 5])
    assert times.links["slack"] == pytest.approx([88, -15, 88, -15])
    assert times.late_share() == 0.5
    assert times.late_share(10.0) == 0.5 and times.late_share(20.0) == 0.0


def test_the_command_prints_the_table_and_refuses_spans_without_chained_rounds(tmp_path, capsys):
    spans = tmp_path / "spans.jsonl"
    spans.write_text("".join(json.dumps(s) + "\n" for s in request("a", 0)))
    report = main(["--spans", str(spans), "--wait-ms", "10"])
    assert report.splitlines()[0] == "2 rounds that pre-drafted and chained their successor"
    assert report.splitlines()[-1] == (
        "successor after its pass ended: 50.0%; more than 10 ms after (missed it): 50.0%"
    )
    assert "slack" in capsys.readouterr().out
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps(span("c", "r0", None, "round", 0, 10)) + "\n")
    with pytest.raises(SystemExit):
        main(["--spans", str(plain)])
