"""The γ policy on hand-made costs: speculation pays on an idle verifier and steps aside under load."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.speculation_policy import (
    MIN_TIMED_ROUNDS,
    RECHECK_AFTER,
    AcceptanceRate,
    PassLoad,
    RoundTimes,
    choose_gamma,
    expected_tokens,
    fresh_draft_pays,
    round_ns,
)
from specdec.engine.step_cost import StepCost

MS = 1e6


def loads(verify_rows: float, fixed_ms=40.0, per_token_ms=2.0, draft_ms=4.0) -> tuple[PassLoad, PassLoad]:
    verify = PassLoad(StepCost(fixed_ms * MS, per_token_ms * MS), rows=verify_rows)
    draft = PassLoad(StepCost(draft_ms * MS, 0.0), rows=verify_rows)
    return verify, draft


def test_expected_tokens_follows_the_closed_form():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_an_idle_verifier_with_a_fixed_cost_speculates():
    verify, draft = loads(verify_rows=1)
    assert choose_gamma(0.6, 8, verify, draft) >= 2


def test_gamma_shrinks_as_the_batch_grows_and_reaches_plain_decoding():
    chosen = [choose_gamma(0.6, 8, *loads(verify_rows=rows)) for rows in (1, 2, 4, 8, 16, 32, 64)]
    assert chosen == sorted(chosen, reverse=True)
    assert chosen[0] > 0 and chosen[-1] == 0


def test_acceptance_sets_the_depth():
    verify, draft = loads(verify_rows=1)
    assert choose_gamma(0.02, 8, verify, draft) == 0  # a draft the target never agrees with is not worth a pass
    assert choose_gamma(0.99, 8, verify, draft) == 8  # nearly free tokens: as deep as allowed
    assert choose_gamma(0.99, 3, verify, draft) == 3
    assert choose_gamma(0.99, 8, verify, None) == 0


def test_costs_and_batch_size_are_learned_from_replies():
    verify, _ = loads(verify_rows=1, fixed_ms=40.0, per_token_ms=0.0)  # calibration said: tokens are free
    for rows in (4, 8, 16, 32, 4, 8, 16, 32):
        verify.observe(tokens=5 * rows, ns=(40.0 + 3.0 * 5 * rows) * MS, rows=rows)  # live: 3 ms per token
    assert verify.cost.per_token_ns > 1.5 * MS
    assert 8 < verify.rows < 32


def test_a_requests_acceptance_moves_from_the_global_rate_to_its_own():
    rate = AcceptanceRate()
    for _ in range(400):
        rate.observe(judged=4, accepted=3)
    assert rate.value == pytest.approx(0.75, abs=0.01)
    assert rate.for_request(0, 0) == pytest.approx(0.75, abs=0.01)
    assert rate.for_request(judged=200, accepted=20) < 0.15


def test_time_outside_the_services_is_paid_once_more_per_speculative_round():
    verify, draft = loads(verify_rows=8)
    without = choose_gamma(0.6, 8, verify, draft)
    for _ in range(50):
        draft.observe_call(60 * MS)  # a drafter call that waits long outside the service
    assert 0 == choose_gamma(0.6, 8, verify, draft) <= without


def test_draft_time_hidden_by_predrafts_allows_deeper_blocks():
    verify = PassLoad(StepCost(40 * MS, 1.25 * MS), rows=1)
    draft = PassLoad(StepCost(12 * MS, 0.0), rows=1)  # a slow drafter: every drafted token costs 12 ms
    sequential = choose_gamma(0.6, 8, verify, draft)
    overlapped = choose_gamma(0.6, 8, verify, draft, predraft_hit_rate=0.8)
    assert overlapped > sequential
    assert choose_gamma(0.6, 8, verify, draft, predraft_hit_rate=0.0) == sequential


def test_under_load_a_request_whose_verdicts_are_seldom_guessed_turns_to_plain_decoding_first():
    """Overlapped, 16 sessions per pass: a fresh draft arrives while the verifier runs the pass of the sessions
    whose blocks were pre-drafted, and waits for it. A request with pre-draft hit rate 0.1 then decodes plainly
    where one with 0.9 speculates; on an idle verifier there is no such pass and both speculate."""
    busy, busy_draft = loads(verify_rows=16)
    assert choose_gamma(0.8, 8, busy, busy_draft, predraft_hit_rate=0.9) > 0
    assert choose_gamma(0.8, 8, busy, busy_draft, predraft_hit_rate=0.1) == 0
    assert round_ns(2, busy, busy_draft, 0.1) > round_ns(2, busy, busy_draft, 0.9) > round_ns(2, busy, busy_draft, 1.0)
    idle, idle_draft = loads(verify_rows=1)
    assert choose_gamma(0.8, 8, idle, idle_draft, predraft_hit_rate=0.1) > 0
    draft_wait_ns = round_ns(2, idle, idle_draft, 0.1) - round_ns(2, idle, idle_draft, 1.0)
    assert draft_wait_ns == pytest.approx(0.9 * 2 * 4 * MS)  # the misses' two draft passes, nothing more


def test_the_running_fit_equals_a_least_squares_fit_of_the_window():
    cost = StepCost(30 * MS, 1 * MS, window=8)
    generator = np.random.default_rng(0)
    passes = [
        (int(tokens), 20 * MS + 2 * MS * tokens + generator.normal(0, MS))
        for tokens in generator.integers(1, 50, size=40)
    ]
    for tokens, ns in passes:
        cost.observe(tokens, ns)
    points = [(1, 31 * MS), (64, 94 * MS), *passes[-8:]]  # the calibration anchors stay, the window slides
    per_token, fixed = np.polyfit([x for x, _ in points], [y for _, y in points], 1)
    assert cost.per_token_ns == pytest.approx(per_token, rel=1e-6)
    assert cost.fixed_ns == pytest.approx(fixed, rel=1e-6)


def test_measured_round_slowdowns_move_gamma_at_their_own_load():
    """Speculative rounds measured at twice their predicted time on a busy verifier (16 sessions per pass)
    turn speculation off there; an idle verifier's choice is untouched, and a few rounds change nothing."""
    busy, busy_draft = loads(verify_rows=16)
    idle, idle_draft = loads(verify_rows=1)
    times = RoundTimes()
    speculating = choose_gamma(0.6, 8, busy, busy_draft, round_times=times)
    assert speculating > 0
    for _ in range(MIN_TIMED_ROUNDS):
        assert choose_gamma(0.6, 8, busy, busy_draft, round_times=times) == speculating  # too few rounds yet
        times.observe(True, 16, 2 * round_ns(3, busy, busy_draft), round_ns(3, busy, busy_draft))
        times.observe(False, 16, round_ns(0, busy, busy_draft), round_ns(0, busy, busy_draft))
    assert times.slowdown(True, 16) == pytest.approx(2.0) and times.slowdown(False, 16) == pytest.approx(1.0)
    assert choose_gamma(0.6, 8, busy, busy_draft, round_times=times) == 0
    assert times.slowdown(True, 1) == 1.0
    assert choose_gamma(0.6, 8, idle, idle_draft, round_times=times) == choose_gamma(0.6, 8, idle, idle_draft)


def test_a_kind_left_untimed_at_a_load_gets_a_round_there_to_be_timed_again():
    """Speculative rounds once timed at 10x their prediction (a queue building up) turn speculation off; after
    RECHECK_AFTER plain rounds one speculative round runs, each such round halves the stale excess, and
    speculation is back for good within a few of them. A kind measured no slower than the other is not
    re-timed; plain rounds measured slower are, the same way, and a claim is handed out once."""
    busy, busy_draft = loads(verify_rows=16)
    times = RoundTimes()
    speculative_ns = round_ns(3, busy, busy_draft)
    for _ in range(MIN_TIMED_ROUNDS):
        times.observe(True, 16, 10 * speculative_ns, speculative_ns)
    chosen = []
    for _ in range(200):
        gamma = choose_gamma(0.6, 8, busy, busy_draft, round_times=times)
        chosen.append(gamma)
        predicted = round_ns(gamma, busy, busy_draft)
        times.observe(gamma > 0, 16, predicted, predicted)
    assert chosen[:RECHECK_AFTER] == [0] * RECHECK_AFTER
    assert chosen[RECHECK_AFTER] > 0, "the speculative round due for a re-timing"
    assert all(gamma > 0 for gamma in chosen[8 * (RECHECK_AFTER + 1) :]), "speculation is back once re-timed"
    assert times.slowdown(True, 16) < 1.1
    plain_ns = round_ns(0, busy, busy_draft)
    for _ in range(MIN_TIMED_ROUNDS):
        times.observe(False, 16, 3 * plain_ns, plain_ns)
    for _ in range(RECHECK_AFTER):
        times.observe(True, 16, speculative_ns, speculative_ns)
    assert times.claim_recheck(16) is False and times.claim_recheck(16) is None
    assert times.claim_recheck(1) is None, "other loads keep their own counts"


def test_after_an_unguessed_verdict_an_idle_verifier_drafts_afresh_and_a_busy_one_takes_a_plain_step():
    # idle: a fresh block costs the draft time and one pass; loaded: also the pass run meanwhile for the others
    assert fresh_draft_pays(0.6, 4, *loads(verify_rows=1))
    assert not fresh_draft_pays(0.6, 4, *loads(verify_rows=16))
    assert not fresh_draft_pays(0.05, 4, *loads(verify_rows=1))  # a draft that seldom lands is not worth a wait
