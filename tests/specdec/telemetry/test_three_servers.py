"""Tracing and metrics across the three real servers: one trace per request, rounds as in the stats,
and /metrics counters equal to the sum of the responses' stats."""

from __future__ import annotations

import socket
import time
import urllib.request
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specdec.client import Client, build_request
from specdec.local_stack import LocalStack
from specdec.telemetry.timeline import main as timeline_main
from specdec.telemetry.timeline import read_spans
from specdec.v1 import coordinator_pb2_grpc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class TracedStack:
    stack: LocalStack
    spans_path: object
    coordinator_metrics: int
    draft_metrics: int
    verify_metrics: int


@pytest.fixture(scope="module")
def traced(tiny_pair_dirs, tmp_path_factory):
    target_dir, draft_dir = tiny_pair_dirs
    spans_path = tmp_path_factory.mktemp("telemetry") / "spans.jsonl"
    coordinator_port, draft_port, verify_port = free_port(), free_port(), free_port()
    # The exporter comes from the environment, so the verify service honours it without a flag of its own.
    # Fixed γ: every round drafts, so every round has draft spans (adaptive γ would not draft on the tiny pair).
    with LocalStack(
        str(target_dir),
        str(draft_dir),
        env={"SPECDEC_TRACE_EXPORTER": f"jsonl:{spans_path}"},
        coordinator_args=["--metrics-port", str(coordinator_port), "--no-adaptive-gamma"],
        draft_args=["--metrics-port", str(draft_port)],
        verify_args=["--metrics-port", str(verify_port)],
    ) as stack:
        yield TracedStack(stack, spans_path, coordinator_port, draft_port, verify_port)


@pytest.fixture(scope="module")
def client(traced):
    with Client(traced.stack.address, timeout_s=60) as c:
        yield c


def trace_of(traced: TracedStack, request_id: str) -> list[dict]:
    """The spans of the trace of the Generate call with the client's `request_id` (once that call's span ended)."""
    deadline = time.monotonic() + 20
    while True:
        spans = read_spans([traced.spans_path]) if traced.spans_path.exists() else []
        calls = [
            s
            for s in spans
            if s["name"] == "specdec.v1.Coordinator/Generate"
            and s["attributes"].get("specdec.request_id") == request_id
        ]
        if calls:
            return [s for s in spans if s["trace_id"] == calls[0]["trace_id"]]
        assert time.monotonic() < deadline, f"no finished trace for {request_id}"
        time.sleep(0.2)


def test_one_request_is_one_trace_with_draft_and_verify_spans_under_the_right_round(traced, client):
    reply = client.generate(
        [5, 9, 13], max_new_tokens=24, num_speculative_tokens=3, include_stats=True, request_id="traced-1"
    )
    spans = trace_of(traced, "traced-1")
    by_id = {s["span_id"]: s for s in spans}
    [generate] = [s for s in spans if s["name"] == "generate"]
    session_id = generate["attributes"]["specdec.request_id"]  # what the coordinator opened the sessions as
    mentioning = {
        s["trace_id"]
        for s in read_spans([traced.spans_path])
        if s["attributes"].get("specdec.session_id") == session_id
    }
    assert mentioning == {generate["trace_id"]}  # every service's spans of the request: one trace
    assert {s["role"] for s in spans} == {"coordinator", "draft", "verify"}

    rounds = sorted((s for s in spans if s["name"] == "round"), key=lambda s: s["attributes"]["specdec.round"])
    assert len(rounds) == reply.stats.rounds
    assert [r["attributes"]["specdec.round"] for r in rounds] == list(range(1, reply.stats.rounds + 1))
    commit_of = {s["parent_span_id"]: s["attributes"] for s in spans if s["name"] == "commit"}
    assert set(commit_of) == {r["span_id"] for r in rounds}

    def round_above(span: dict, client_span: str) -> dict:
        """The round span above a service's server span, through the coordinator's client span."""
        call = by_id[span["parent_span_id"]]
        assert call["name"] == client_span and call["role"] == "coordinator" and call["kind"] == "CLIENT"
        round_span = by_id[call["parent_span_id"]]
        assert round_span["name"] == "round"
        return round_span

    verify_calls = [s for s in spans if s["name"] == "verify" and s["role"] == "coordinator"]
    # round 1 commits the first token, which came with the verifier's open; every later round has its verify call
    assert sorted(s["parent_span_id"] for s in verify_calls) == sorted(r["span_id"] for r in rounds[1:])
    chained = [s for s in verify_calls if s["attributes"]["specdec.chained"]]
    assert len(chained) == reply.stats.chained_rounds
    verifies = [s for s in spans if s["name"] == "specdec.v1.Verifier/Verify"]
    assert all(s["role"] == "verify" and s["kind"] == "SERVER" for s in verifies)
    assert sorted(round_above(s, "verify")["span_id"] for s in verifies) == sorted(
        c["parent_span_id"] for c in verify_calls if not c["attributes"]["specdec.chained"]
    )
    verify_nexts = [s for s in spans if s["name"] == "specdec.v1.Verifier/VerifyNext"]
    assert len(verify_nexts) >= len(chained)  # a chained round's candidates went out in the round before it
    for span in verify_nexts:  # sent in the round whose verdict it waits for
        round_above(span, "verify_next")
    for span in verifies:  # the round that verified base_len b is the one whose commit started at b
        assert (
            span["attributes"]["specdec.base_len"]
            == commit_of[round_above(span, "verify")["span_id"]]["specdec.base_len"]
        )

    proposes = [s for s in spans if s["name"] == "specdec.v1.Drafter/ProposeLanes"]
    assert proposes and all(s["role"] == "draft" for s in proposes)
    for span in proposes:  # a fresh block and a pre-draft both start from the round's committed length
        call = by_id[span["parent_span_id"]]
        commit = commit_of[round_above(span, "draft.propose")["span_id"]]
        assert call["attributes"]["specdec.base_len"] == commit["specdec.base_len"]
        assert call["attributes"]["specdec.lanes"] >= 1

    def total_ns(name: str) -> int:
        return sum(s["end_ns"] - s["start_ns"] for s in spans if s["name"] == name)

    assert total_ns("draft.forward") == reply.stats.draft_ns
    assert total_ns("verify.forward") == reply.stats.verify_ns
    assert total_ns("verify.sampling") == reply.stats.sampling_ns
    assert {s["attributes"].get("specdec.lane") for s in spans if s["name"].startswith("verify.")} >= {"verify"}


def test_a_callers_trace_context_is_continued(traced):
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    request = build_request([1, 2, 3], max_new_tokens=4, request_id="traced-2")
    with grpc.insecure_channel(traced.stack.address) as channel:
        coordinator_pb2_grpc.CoordinatorStub(channel).Generate(
            request, timeout=60, metadata=[("traceparent", f"00-{trace_id}-00f067aa0ba902b7-01")]
        )
    assert {s["trace_id"] for s in trace_of(traced, "traced-2")} == {trace_id}


def test_timeline_png_from_a_requests_trace(traced, client, tmp_path):
    client.generate([7, 8], max_new_tokens=12, num_speculative_tokens=2, request_id="traced-3")
    trace_of(traced, "traced-3")
    out = tmp_path / "timeline.png"
    timeline_main(["--spans", str(traced.spans_path), "--request-id", "traced-3", "--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def difference(before: dict, after: dict) -> Callable[..., float]:
    """delta(name, **labels): how much a sample grew from one scrape to the next (0 where absent)."""

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    return delta


def test_metrics_counters_equal_the_sum_of_the_responses_stats(traced, client):
    before = scrape(traced.coordinator_metrics)
    replies = [
        client.generate(
            prompt, max_new_tokens=20, num_speculative_tokens=gamma, temperature=temperature, seed=7, include_stats=True
        )
        for prompt, gamma, temperature in [
            ([3, 4, 5], 3, 0.0),
            ([9, 1], 1, 1.0),
            ([2, 2, 7, 30], 4, 0.8),
            ([11], 0, 0.0),
        ]
    ]
    with pytest.raises(grpc.RpcError):
        client.generate([1, 2], max_new_tokens=0)
    generate = "/specdec.v1.Coordinator/Generate"
    for _ in range(100):  # the server counts an RPC as its handler ends, maybe just after the client's status
        after = scrape(traced.coordinator_metrics)
        delta = difference(before, after)
        if delta("specdec_grpc_server_errors_total", grpc_method=generate, grpc_code="INVALID_ARGUMENT") == 1:
            break
        time.sleep(0.05)

    stats = [r.stats for r in replies]
    total = defaultdict(int)
    for s in stats:
        for field in (
            "rounds",
            "drafted_tokens",
            "accepted_tokens",
            "predraft_attempts",
            "predraft_hits",
            "chained_rounds",
            "prompt_tokens",
            "draft_ns",
            "verify_ns",
            "sampling_ns",
            "wire_ns",
            "prefill_ns",
        ):
            total[field] += getattr(s, field)
        for position, (drafted, accepted) in enumerate(zip(s.drafted_per_position, s.accepted_per_position)):
            total[f"drafted@{position}"] += drafted
            total[f"accepted@{position}"] += accepted

    assert delta("specdec_rounds_total") == total["rounds"] == delta("specdec_tokens_per_round_count")
    assert delta("specdec_drafted_tokens_total") == total["drafted_tokens"]
    assert delta("specdec_accepted_tokens_total") == total["accepted_tokens"]
    assert delta("specdec_tokens_per_round_sum") == total["accepted_tokens"] + total["rounds"]
    assert delta("specdec_predraft_attempts_total") == total["predraft_attempts"]
    assert delta("specdec_predraft_hits_total") == total["predraft_hits"]
    assert delta("specdec_chained_rounds_total") == total["chained_rounds"]
    assert delta("specdec_prompt_tokens_total") == total["prompt_tokens"]
    assert delta("specdec_generated_tokens_total") == sum(len(r.token_ids) for r in replies)
    for position in range(4):
        assert delta("specdec_drafted_tokens_by_position_total", position=str(position)) == total[f"drafted@{position}"]
        assert (
            delta("specdec_accepted_tokens_by_position_total", position=str(position)) == total[f"accepted@{position}"]
        )
    for stage in ("draft", "verify", "sampling", "wire", "prefill"):
        assert delta("specdec_stage_duration_seconds_sum", stage=stage) == pytest.approx(
            total[f"{stage}_ns"] / 1e9, rel=1e-6, abs=1e-9
        )
    assert delta("specdec_time_to_first_token_seconds_count") == len(replies)
    # One observation per token after each request's first chunk (which may hold several tokens).
    assert 0 < delta("specdec_inter_token_latency_seconds_count") <= sum(len(r.token_ids) - 1 for r in replies)
    assert delta("specdec_grpc_server_requests_total", grpc_method=generate, grpc_code="OK") == len(replies)
    assert delta("specdec_grpc_server_errors_total", grpc_method=generate, grpc_code="INVALID_ARGUMENT") == 1
    assert after[("specdec_active_requests", ())] == 0


def test_draft_service_exports_its_sessions_and_kv_cache(traced, client):
    stream = client.stream([4, 5, 6], max_new_tokens=200, num_speculative_tokens=1)
    next(stream)  # the first token, which comes with the verifier's open
    next(stream)  # a round's, which waited for the drafter's open too
    during = scrape(traced.draft_metrics)
    stream.cancel()
    assert during[("specdec_active_sessions", ())] >= 1 and during[("specdec_kv_cache_tokens", ())] >= 3
    assert (
        during[
            (
                "specdec_grpc_server_requests_total",
                (("grpc_code", "OK"), ("grpc_method", "/specdec.v1.Drafter/OpenSession")),
            )
        ]
        >= 1
    )
    deadline = time.monotonic() + 20
    while scrape(traced.draft_metrics)[("specdec_active_sessions", ())] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert scrape(traced.draft_metrics)[("specdec_active_sessions", ())] == 0


def test_verify_service_exports_its_passes_with_and_without_prefill(traced, client):
    before = scrape(traced.verify_metrics)
    prompts = [[3, 4, 5, 6, 7], [9, 1, 8]]
    replies = [
        client.generate(prompt, max_new_tokens=12, num_speculative_tokens=3, include_stats=True) for prompt in prompts
    ]
    after = scrape(traced.verify_metrics)
    delta = difference(before, after)

    # One request at a time: each open is a pass of its own, prefilling every prompt token (the last one's row kept).
    assert delta("specdec_verify_pass_duration_seconds_count", prefill="with") == len(prompts)
    assert delta("specdec_verify_pass_tokens_total", kind="prefill") == sum(len(p) for p in prompts)
    # Every committed round after the first token (which the open draws from the kept row) was scored, γ + 1 tokens
    # (the first one's block feeds the first token with it); candidate rounds run ahead and then dropped add to it.
    assert delta("specdec_verify_pass_tokens_total", kind="scored") >= sum(
        r.stats.drafted_tokens + r.stats.rounds - 1 for r in replies
    )
    assert delta("specdec_verify_pass_duration_seconds_count", prefill="without") >= sum(
        r.stats.rounds - 1 for r in replies
    )
    assert delta("specdec_verify_pass_duration_seconds_sum", prefill="without") > 0
