"""The speculation gate on a hand-driven clock: epochs of each way, the faster kept, the slower re-measured."""

from __future__ import annotations

import pytest

from coordinator.speculation_gate import (
    EPOCH_S,
    MIN_EPOCHS,
    RECHECK_CLOSE,
    RECHECK_WIDE,
    SETTLE_S,
    SPECULATION_MARGIN,
    SpeculationGate,
)
from coordinator.speculation_policy import PassLoad, log2_level, speculation_gain
from specdec.engine.step_cost import StepCost

MS = 1e6


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_epoch(gate: SpeculationGate, clock: Clock, tokens_per_s: dict[bool, float], contested: bool = True) -> bool:
    """One epoch: the way the gate picks at its start, then commits at that way's rate every 0.1 s."""
    speculative = gate.allows_speculation(lambda: contested)
    start = clock.now
    while clock.now < start + EPOCH_S:
        clock.now += 0.1
        gate.committed(round(tokens_per_s[speculative] * 0.1))
        assert gate.allows_speculation(lambda: contested) == speculative or clock.now >= start + EPOCH_S
    return speculative


def gate_at(active: int) -> tuple[SpeculationGate, Clock]:
    clock = Clock()
    gate = SpeculationGate(clock=clock)
    for _ in range(active):
        gate.enter()
    return gate, clock


def test_both_ways_are_measured_then_the_faster_is_kept_and_the_slower_rechecked():
    gate, clock = gate_at(16)
    rates = {True: 150.0, False: 160.0}  # plain faster, by less than the close gap
    ways = [run_epoch(gate, clock, rates) for _ in range(2 * MIN_EPOCHS + 2 * RECHECK_CLOSE)]
    assert ways[: 2 * MIN_EPOCHS] == [True, False, True, False]
    kept = ways[2 * MIN_EPOCHS :]
    assert kept.count(False) > kept.count(True) >= 1  # plain most of the time, speculation re-measured
    assert gate.throughput(4, False).tokens_per_s == pytest.approx(160.0, rel=0.05)
    assert gate.throughput(4, True).tokens_per_s == pytest.approx(150.0, rel=0.05)


@pytest.mark.parametrize("lead, kept_way", [(SPECULATION_MARGIN / 2, False), (2 * SPECULATION_MARGIN, True)])
def test_speculation_is_kept_only_when_it_leads_by_the_margin(lead, kept_way):
    gate, clock = gate_at(16)
    rates = {True: 160.0 * (1 + lead), False: 160.0}
    ways = [run_epoch(gate, clock, rates) for _ in range(2 * MIN_EPOCHS + 2 * RECHECK_CLOSE)]
    kept = ways[2 * MIN_EPOCHS :]
    assert kept.count(kept_way) > kept.count(not kept_way) >= 1


def test_a_wide_gap_is_rechecked_less_often():
    gate, clock = gate_at(16)
    ways = [run_epoch(gate, clock, {True: 300.0, False: 100.0}) for _ in range(2 * MIN_EPOCHS + RECHECK_WIDE)]
    assert ways[2 * MIN_EPOCHS :].count(False) == 1


def test_a_heavier_load_than_one_that_keeps_plain_starts_plain_and_rechecks_speculation():
    gate, clock = gate_at(16)
    for _ in range(2 * MIN_EPOCHS):
        run_epoch(gate, clock, {True: 150.0, False: 200.0})  # level 4 keeps plain rounds
    for _ in range(48):
        gate.enter()  # 64 running: level 6, not measured yet
    ways = [run_epoch(gate, clock, {True: 150.0, False: 200.0}) for _ in range(2 * RECHECK_WIDE)]
    assert ways.count(True) == 2  # no exploring epochs of speculation, only the rechecks
    assert gate.throughput(6, True).epochs == 2 and gate.throughput(6, False).epochs == 2 * RECHECK_WIDE - 2


def test_a_lighter_load_than_one_that_keeps_plain_still_measures_both_ways():
    gate, clock = gate_at(16)
    for _ in range(2 * MIN_EPOCHS):
        run_epoch(gate, clock, {True: 150.0, False: 200.0})
    for _ in range(12):
        gate.leave()  # 4 running: level 2
    ways = [run_epoch(gate, clock, {True: 300.0, False: 200.0}) for _ in range(2 * MIN_EPOCHS)]
    assert ways == [True, False, True, False]


def test_the_settling_start_of_an_epoch_is_not_measured():
    gate, clock = gate_at(1)
    assert gate.allows_speculation(lambda: True)
    clock.now = SETTLE_S / 2
    gate.committed(1000)  # the previous way's rounds finishing: not counted
    clock.now = SETTLE_S
    gate.committed(10)  # the mark
    clock.now = EPOCH_S
    gate.committed(100)
    gate.allows_speculation(lambda: True)  # the next epoch starts: the first one is recorded
    assert gate.throughput(0, True).tokens_per_s == pytest.approx(100 / (EPOCH_S - SETTLE_S))


def test_an_uncontested_load_always_speculates_and_runs_no_plain_epoch():
    gate, clock = gate_at(1)
    assert all(run_epoch(gate, clock, {True: 50.0, False: 100.0}, contested=False) for _ in range(10))
    assert gate.throughput(0, False).epochs == 0


def test_the_prediction_is_not_asked_for_during_a_speculative_epoch():
    gate, clock = gate_at(16)
    asked = []
    assert gate.allows_speculation(lambda: asked.append(1) or True)  # the epoch starts: asked once
    clock.now = 1.0
    assert gate.allows_speculation(lambda: asked.append(1) or True)
    assert len(asked) == 1


def test_a_request_whose_gain_is_wide_speculates_through_a_plain_epoch():
    gate, clock = gate_at(16)
    run_epoch(gate, clock, {True: 100.0, False: 100.0})
    assert not gate.allows_speculation(lambda: True)  # the second epoch measures plain rounds
    assert gate.allows_speculation(lambda: False)


def test_a_change_of_load_starts_a_new_epoch_and_drops_the_unfinished_one():
    gate, clock = gate_at(16)
    gate.allows_speculation(lambda: True)
    clock.now = 1.0
    gate.committed(10)
    for _ in range(12):
        gate.leave()  # 4 left: another load level
    clock.now = 2.0
    gate.allows_speculation(lambda: True)
    assert gate.throughput(4, True).epochs == 0 and log2_level(gate.active) == 2


def test_the_gain_the_gate_consults_falls_as_the_batch_grows():
    def gain(rows: float) -> float:
        verify = PassLoad(StepCost(30 * MS, 1.5 * MS), rows=rows)
        draft = PassLoad(StepCost(4 * MS, 0.1 * MS), rows=rows)
        return speculation_gain(0.55, 4, verify, draft, predraft_hit_rate=0.7)

    assert gain(1) > 1.5 > gain(16) and gain(16) < gain(4) < gain(1)
