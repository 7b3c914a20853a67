"""Guessed verdicts and draft lanes (coordinator/verdict_guesses.py) and how many guesses fit (speculation_policy)."""

from __future__ import annotations

from types import SimpleNamespace

from coordinator.block_sizing import BlockSizer
from coordinator.draft_lanes import DraftLane
from coordinator.request_plan import GenerationPlan
from coordinator.speculation_policy import PassLoad, affordable_guesses, predraft_steps
from coordinator.verdict_guesses import Guess, VerdictHistory, assign_lanes, guesses
from specdec.engine.step_cost import StepCost
from specdec.sampling.rules import SamplingParams

BLOCK = [11, 12, 13]
ALTERNATIVES = [[21, 31], [22, 32], [23]]  # per position, the draft's next most likely other tokens


def test_guesses_put_all_accepted_first_then_rejections_rank_by_rank():
    assert guesses(BLOCK, ALTERNATIVES, 0) == [Guess(3, None)]
    assert guesses(BLOCK, ALTERNATIVES, 1) == [Guess(3, None), Guess(0, 21), Guess(1, 22), Guess(2, 23)]
    assert guesses(BLOCK, ALTERNATIVES, 2)[4:] == [Guess(0, 31), Guess(1, 32)]  # position 2 has no second one
    assert guesses(BLOCK, [], 2) == [Guess(3, None)]  # a drafter that ranks no alternatives (n-gram)


def test_a_guess_names_the_sequence_to_draft_after_and_the_verdict_it_stands_for():
    committed = [1, 2]
    assert Guess(3, None).sequence(committed, BLOCK) == [1, 2, 11, 12, 13]
    assert Guess(1, 22).sequence(committed, BLOCK) == [1, 2, 11, 22]
    # "all accepted": the verdict's bonus token must be what the lane drafted first.
    assert Guess(3, None).verdict([40, 41]) == (3, 40)
    assert Guess(3, None).verdict([41, 40]) != (3, 40) and Guess(3, None).verdict([40]) != (2, 40)
    assert Guess(3, None).verdict([]) is None  # the lane drafted nothing: no verdict to match
    assert Guess(1, 22).verdict([50]) == (1, 22) and Guess(1, 22).verdict([50]) != (1, 23)
    assert Guess(1, 22).verdict([50]) != (2, 22)


def test_a_lane_syncs_through_the_longest_prefix_it_shares_with_the_new_sequence():
    lane = DraftLane(0, [1, 2], committed_len=2)
    committed = [1, 2]
    guess = Guess(1, 22)
    lane.synced(guess.sequence(committed, BLOCK), [60, 61], committed_len=len(committed))
    assert lane.held == [1, 2, 11, 22, 60, 61]
    assert lane.sync_to([1, 2, 11, 22, 60, 61, 70]) == (6, [70])  # the guess was right and its block accepted
    assert lane.sync_to([1, 2, 11, 22, 60, 99]) == (5, [99])  # right guess, then a rejection in its block
    assert lane.sync_to([1, 2, 11, 12, 13, 40]) == (3, [12, 13, 40])  # wrong guess: back to the shared prefix
    assert lane.sync_to([1, 2, 14]) == (2, [14])


def _load(fixed_ms: float, per_token_ms: float, rows: float) -> PassLoad:
    return PassLoad(StepCost(fixed_ms * 1e6, per_token_ms * 1e6), rows=rows)


def test_guesses_are_limited_to_what_the_drafter_finishes_within_the_verification():
    verify = _load(40, 1.25, 1)  # one session, 5 tokens: 46.25 ms
    cheap_draft = _load(6, 0.25, 1)  # 5 passes of 9 rows: 41.25 ms
    assert affordable_guesses(9, 5, 5, verify, cheap_draft) == 9
    slow_draft = _load(8, 1.0, 1)  # 5 passes cost 40 ms + 5 ms per row: 1 guess fits
    assert affordable_guesses(9, 5, 5, verify, slow_draft) == 1
    busy_draft = _load(6, 0.25, 40)  # the drafter's batch is already 40 rows: 80 ms for 5 passes
    assert affordable_guesses(9, 5, 5, verify, busy_draft) == 1
    assert affordable_guesses(9, 5, 5 * 16, _load(40, 1.25, 16), busy_draft) == 9  # a busy verifier hides them


def test_a_predraft_makes_only_the_passes_that_end_within_the_verification():
    verify = _load(14, 0.01, 1)  # an accelerator's weight-bound target: ~14 ms however many tokens
    draft = _load(3.6, 0.01, 1)  # a draft step a quarter of it
    assert predraft_steps(5, 5, verify, draft) == 3  # 4 passes (14.5 ms) would outlast the verification
    assert predraft_steps(2, 5, verify, draft) == 2  # never more than the block asks for
    assert predraft_steps(5, 5, verify, _load(30, 0.1, 1)) == 1  # at least one pass, however slow
    cpu_verify = _load(40, 1.25, 1)  # a CPU's target, where a draft step is a tenth of a verification
    cpu_draft = _load(4, 1.0, 9)  # each row costs: the drafter fed 9 rows a pass, this request's last 9 lanes
    assert predraft_steps(6, 5, cpu_verify, cpu_draft, own_rows=9) == 6  # depth as fits with one row
    assert predraft_steps(6, 5, cpu_verify, cpu_draft) == 3  # 9 other sessions' rows leave room for 3 passes


def test_verdicts_rank_the_guesses_they_matched_first_and_keep_the_fixed_order_between_equals():
    history = VerdictHistory()
    candidates = guesses(BLOCK, ALTERNATIVES, 2)  # all accepted, (0, 21), (1, 22), (2, 23), (0, 31), (1, 32)
    assert history.rank(candidates) == candidates
    history.observe(3, ALTERNATIVES, 1, 32)  # rejected at position 1, the verifier's token the draft's 2nd choice
    history.observe(3, ALTERNATIVES, 1, 32)
    history.observe(3, ALTERNATIVES, 2, 23)
    history.observe(3, ALTERNATIVES, 3, 99)  # all accepted (the bonus token does not matter)
    history.observe(3, ALTERNATIVES, 0, 77)  # a token the draft did not rank: counts nowhere
    assert history.rank(candidates) == [
        Guess(1, 32),
        Guess(3, None),
        Guess(2, 23),
        Guess(0, 21),
        Guess(1, 22),
        Guess(0, 31),
    ]
    # Ranks, not tokens, are what repeat: a new block's guesses at the same position and rank come first.
    assert history.rank(guesses([5, 6, 7], [[8, 9], [10, 11], [12]], 2))[0] == Guess(1, 11)


def test_all_accepted_counts_as_one_outcome_whatever_the_blocks_length():
    """Blocks vary in length (lookup tokens, a constraint's forced text): a request whose blocks are mostly accepted
    whole ranks "all accepted" first for a block of a length it has not seen, above a rejection seen twice."""
    history = VerdictHistory()
    for drafted in (3, 5, 7):
        history.observe(drafted, [[21]] * drafted, drafted, 99)
    history.observe(3, ALTERNATIVES, 1, 22)
    history.observe(3, ALTERNATIVES, 1, 22)
    block = [1, 2, 3, 4, 5, 6]
    assert history.rank(guesses(block, [[21, 31]] * 6, 2))[0] == Guess(6, None)


def test_all_accepted_keeps_the_blocks_lane_and_every_guess_gets_a_lane_of_its_own():
    lanes = [DraftLane(index, [1], 1) for index in range(3)]
    with_all = assign_lanes([Guess(3, None), Guess(0, 21), Guess(1, 22)], lanes, block_lane=1)
    assert [(guess.next_token, lane.index) for guess, lane in with_all] == [(None, 1), (21, 0), (22, 2)]
    # The history ranked "all accepted" out: the block's lane serves a rejection guess too.
    without = assign_lanes([Guess(0, 21), Guess(1, 22), Guess(2, 23), Guess(0, 31)], lanes, block_lane=1)
    assert [(guess.next_token, lane.index) for guess, lane in without] == [(21, 0), (22, 2), (23, 1)]


def _sizer(predraft_max_batch: float, verify_rows: float | None) -> BlockSizer:
    plan = GenerationPlan("r", [1, 2], 16, SamplingParams(), 4, 0, True, predraft_max_batch=predraft_max_batch)
    verify = SimpleNamespace(load=None if verify_rows is None else _load(14, 0.01, verify_rows))
    return BlockSizer(SimpleNamespace(plan=plan), SimpleNamespace(verify=verify))


def test_blocks_are_predrafted_only_below_the_verifier_batch_the_plan_sets():
    assert _sizer(4, 1).predrafts() and _sizer(4, 3.9).predrafts()
    assert not _sizer(4, 4).predrafts() and not _sizer(4, 16).predrafts()  # batching: drafted after the verdict
    assert _sizer(4, None).predrafts()  # the verifier's batch not measured yet
    assert _sizer(0, 64).predrafts()  # 0: at any batch
