"""The survival benchmark's bookkeeping: when every verify replica was down, what a failed attempt is put down to,
and the counts of a run against its reference."""

from __future__ import annotations

from benchmarks.fleet import FleetProcess
from benchmarks.survival_chaos import Timeline, cause
from benchmarks.survival_load import Attempt, Outcome, tally


def fleet(*names: str) -> list[FleetProcess]:
    return [FleetProcess("verify" if name.startswith("v") else "coordinator", name, (), None, port=1) for name in names]


def test_every_verify_replica_is_down_only_where_their_outages_overlap():
    timeline = Timeline(fleet("v0", "v1"))
    timeline.down["v0"] = [[10.0, 20.0], [40.0, 45.0]]
    timeline.down["v1"] = [[15.0, 30.0], [50.0, float("inf")]]
    assert timeline.all_down(["v0", "v1"], slack_s=1.0) == [(15.0, 21.0)]


def test_a_failed_attempt_is_put_down_to_its_coordinator_the_verify_outage_or_nothing():
    processes = fleet("c0", "c1", "v0", "v1")
    timeline = Timeline(processes)
    timeline.down["c1"] = [[5.0, 8.0]]
    coordinators = processes[:2]
    outages = [(15.0, 21.0)]
    assert cause(Attempt(1, 4.0, 6.0, "UNAVAILABLE"), coordinators, timeline, outages) == "coordinator_down"
    assert cause(Attempt(0, 14.0, 16.0, "UNAVAILABLE"), coordinators, timeline, outages) == "every_verify_replica_down"
    assert cause(Attempt(0, 14.0, 16.0, "INTERNAL"), coordinators, timeline, outages) == "other"
    assert cause(Attempt(0, 30.0, 31.0, "UNAVAILABLE"), coordinators, timeline, outages) == "other"


def test_tally_counts_failures_by_code_and_outputs_against_the_reference():
    outcomes = [
        Outcome(0, [1, 2], [Attempt(0, 0, 1, "UNAVAILABLE"), Attempt(1, 1, 2, "OK")], verify_moves=1),
        Outcome(1, [3, 9], [Attempt(0, 0, 1, "OK")]),
        Outcome(1, None, [Attempt(0, 0, 1, "RESOURCE_EXHAUSTED")]),
    ]
    counts = tally(outcomes, [[1, 2], [3, 4]])
    assert (counts["requests"], counts["succeeded"], counts["failed"], counts["failed_by_code"]) == (
        3,
        2,
        1,
        {"RESOURCE_EXHAUSTED": 1},
    )
    assert (counts["identical"], counts["differing"], counts["verify_session_moves"], counts["tokens"]) == (1, 1, 1, 4)
