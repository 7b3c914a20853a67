"""Draft lanes: several independent sequences of one session, synced on their own and drafted in one batch."""

from __future__ import annotations

import pytest
import torch

from draft_service.service import DraftService, LaneProposal
from draft_service.settings import DraftSettings
from specdec.common.errors import InvalidFieldError, StaleBaseLenError
from specdec.engine.step_batcher import JoiningStep
from specdec.sampling.rules import SamplingParams

PROMPT = [4, 8, 15, 16, 23]
GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=1.0, seed=3)


@pytest.fixture
def drafter(tiny_pair):
    _, draft = tiny_pair
    return DraftService(DraftSettings(model=""), draft, draft.vocab_size)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_each_lane_drafts_what_a_session_of_its_own_would(drafter, params):
    """Three lanes sent to three different sequences in one call: each lane's block (tokens, q rows, alternatives)
    equals a fresh one-lane session's on that sequence, and each lane can be rolled back on its own later."""
    drafter.open("s", PROMPT, params, "model", num_lanes=3)
    sequences = [PROMPT + [1], PROMPT + [2, 3], PROMPT]
    proposals = [
        LaneProposal(lane, len(PROMPT), seq[len(PROMPT) :], 4, num_alternatives=2) for lane, seq in enumerate(sequences)
    ]
    [results] = drafter.propose_many([("s", proposals)])
    assert [r.batch_rows for r in results] == [3, 3, 3]  # drafted by the same passes
    for index, (sequence, result) in enumerate(zip(sequences, results)):
        drafter.open(f"fresh-{index}", sequence, params, "model")
        fresh = drafter.propose(f"fresh-{index}", len(sequence), [], 4, num_alternatives=2)
        assert result.proposal.token_ids == fresh.proposal.token_ids
        assert result.proposal.alternatives == fresh.proposal.alternatives
        assert result.session_len == len(sequence) + 4
        if params.greedy:
            assert result.proposal.probs is None
        else:
            torch.testing.assert_close(result.proposal.probs, fresh.proposal.probs, rtol=1e-4, atol=1e-6)
    # Lane 1 rolls back to the prompt and follows lane 0's sequence; lanes 0 and 2 are left alone.
    [[moved]] = drafter.propose_many([("s", [LaneProposal(1, len(PROMPT), [1], 4, 2)])])
    assert moved.proposal.token_ids == results[0].proposal.token_ids
    lanes = drafter.sessions.get("s")
    assert [len(lanes.lane(i)) for i in range(3)] == [len(PROMPT) + 5, len(PROMPT) + 5, len(PROMPT) + 4]


def test_alternatives_are_the_drafts_next_most_likely_tokens(drafter, tiny_pair):
    _, draft = tiny_pair
    drafter.open("s", PROMPT, GREEDY, "model")
    result = drafter.propose("s", len(PROMPT), [], 3, num_alternatives=3)
    sequence = list(PROMPT)
    for token, alternatives in zip(result.proposal.token_ids, result.proposal.alternatives):
        with torch.no_grad():
            logits = draft.model(torch.tensor([sequence])).logits[0, -1]  # [V]
        ranked = logits.topk(4).indices.tolist()
        assert ranked[0] == token and alternatives == ranked[1:]
        sequence.append(token)
    assert drafter.propose("s", len(PROMPT), [], 3).proposal.alternatives == []  # none asked, none returned


def test_lanes_are_counted_and_closed_with_their_session(drafter):
    drafter.open("s", PROMPT, GREEDY, "model", num_lanes=4)
    assert len(drafter.sessions) == 1
    drafter.propose_many([("s", [LaneProposal(lane, len(PROMPT), [], 2) for lane in range(4)])])
    assert drafter.sessions.kv_cache_tokens() == 4 * (len(PROMPT) + 1)  # each lane's last draft is still pending
    assert drafter.close("s") and len(drafter.sessions) == 0 and drafter.sessions.kv_cache_tokens() == 0


@pytest.mark.parametrize(
    "proposals, field",
    [
        ([LaneProposal(2, len(PROMPT), [], 2)], "lane"),
        ([LaneProposal(0, len(PROMPT), [], 2), LaneProposal(0, len(PROMPT), [], 1)], "lanes"),
        ([LaneProposal(0, len(PROMPT), [], 2, num_alternatives=99)], "num_alternatives"),
        ([LaneProposal(0, len(PROMPT), [], 99)], "num_speculative_tokens"),
        ([LaneProposal(0, len(PROMPT), [], 2, num_lookup_tokens=99)], "num_lookup_tokens"),
    ],
)
def test_bad_lane_proposals_name_the_field_and_fail_only_their_call(drafter, proposals, field):
    drafter.open("bad", PROMPT, GREEDY, "model", num_lanes=2)
    drafter.open("good", PROMPT, GREEDY, "model")
    bad, good = drafter.propose_many([("bad", proposals), ("good", [LaneProposal(0, len(PROMPT), [], 2)])])
    assert isinstance(bad, InvalidFieldError) and bad.field == field
    assert len(good) == 1 and len(good[0].proposal.token_ids) == 2


def test_a_lane_may_draft_a_block_of_the_largest_gamma_plus_the_bonus_guess(drafter):
    limit = drafter.settings.max_speculative_tokens
    drafter.open("s", PROMPT, GREEDY, "model")
    [[result]] = drafter.propose_many([("s", [LaneProposal(0, len(PROMPT), [], limit + 1)])])
    assert len(result.proposal.token_ids) == limit + 1
    [refused] = drafter.propose_many([("s", [LaneProposal(0, len(PROMPT), [], limit + 2)])])
    assert isinstance(refused, InvalidFieldError) and refused.field == "num_speculative_tokens"


def test_a_stale_lane_is_refused(drafter):
    drafter.open("s", PROMPT, GREEDY, "model", num_lanes=2)
    [refused] = drafter.propose_many([("s", [LaneProposal(1, len(PROMPT) + 2, [], 2)])])
    assert isinstance(refused, StaleBaseLenError)


@pytest.mark.parametrize("num_lanes", [0, 17])
def test_lane_counts_out_of_range_are_refused(drafter, num_lanes):
    with pytest.raises(InvalidFieldError) as raised:
        drafter.open("s", PROMPT, GREEDY, "model", num_lanes=num_lanes)
    assert raised.value.field == "num_lanes" and len(drafter.sessions) == 0


class JoinsBeforeSecondPass(JoiningStep):
    """A step that takes in `later` calls before its second pass and records after how many passes each call was
    answered."""

    def __init__(self, calls, later):
        super().__init__(calls)
        self.later = list(later)
        self.passes = 0  # passes about to run, counted at each join
        self.answered_after: dict[int, int] = {}

    def join(self):
        self.passes += 1
        if self.passes != 2:
            return []
        first = len(self.calls)
        self.calls.extend(self.later)
        self.results.extend([None] * len(self.later))
        return list(range(first, len(self.calls)))

    def finish(self, index, result):
        super().finish(index, result)
        self.answered_after[index] = self.passes


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_call_that_joins_a_running_step_drafts_what_it_would_alone_and_is_answered_when_done(drafter, params):
    """s drafts 5 tokens on lane 0 and 2 on lane 1; t joins before the second pass with 3 tokens, so passes hold
    2, 3, 2, 2, 1 lanes: t is answered after pass 4, s after pass 5, each lane's block what a fresh session drafts."""
    drafter.open("s", PROMPT, params, "model", num_lanes=2)
    drafter.open("t", PROMPT[:3], params, "model")
    step = JoinsBeforeSecondPass(
        [("s", [LaneProposal(0, len(PROMPT), [], 5, 2), LaneProposal(1, len(PROMPT), [7], 2, 2)])],
        [("t", [LaneProposal(0, 3, [9], 3, 2)])],
    )
    drafter.propose_joining(step)
    assert step.answered_after == {1: 4, 0: 5}
    (s0, s1), [t0] = step.results
    assert (s0.batch_rows, s1.batch_rows, t0.batch_rows) == (2, 2, 2)  # 10 lanes over 5 passes; 7 over 3
    for index, (sequence, tokens, result) in enumerate(
        [(PROMPT, 5, s0), (PROMPT + [7], 2, s1), (PROMPT[:3] + [9], 3, t0)]
    ):
        drafter.open(f"fresh-{index}", sequence, params, "model")
        fresh = drafter.propose(f"fresh-{index}", len(sequence), [], tokens, num_alternatives=2)
        assert result.proposal.token_ids == fresh.proposal.token_ids
        assert result.proposal.alternatives == fresh.proposal.alternatives
        assert result.session_len == len(sequence) + tokens
        if not params.greedy:
            torch.testing.assert_close(result.proposal.probs, fresh.proposal.probs, rtol=1e-4, atol=1e-6)


def test_a_lane_synced_to_tokens_another_lane_has_fed_takes_its_cache(drafter, tiny_pair, monkeypatch):
    """Guesses 'rejected at position i' follow the block the first lane drafted: the lanes synced to them take that
    lane's cache and feed only their guessed token, and still draft what sessions of their own would; the first
    lane, whose blocks they now share, drafts on unchanged."""
    _, draft = tiny_pair
    used_before = draft.kv_pool.blocks.used
    drafter.open("s", PROMPT, GREEDY, "model", num_lanes=3)
    [[first]] = drafter.propose_many([("s", [LaneProposal(0, len(PROMPT), [], 4, num_alternatives=1)])])
    block, alternatives = first.proposal.token_ids, first.proposal.alternatives
    sequences = [PROMPT + block, PROMPT + block[:1] + alternatives[1][:1], PROMPT + block[:3] + alternatives[3][:1]]
    fed: list[list[int]] = []  # tokens per lane of every pass
    forward_rows = draft.forward_rows

    def recording(rows):
        fed.append([len(tokens) for tokens, _, _ in rows])
        return forward_rows(rows)

    monkeypatch.setattr(draft, "forward_rows", recording)
    held = [len(sequences[0]), len(PROMPT), len(PROMPT)]  # lane 0 holds its block, the others the prompt
    replaced = [drafter.sessions.get("s").lane(index).session for index in (1, 2)]  # kept alive on purpose
    [results] = drafter.propose_many(
        [("s", [LaneProposal(lane, held[lane], seq[held[lane] :], 3) for lane, seq in enumerate(sequences)])]
    )
    assert fed[0] == [1, 1, 1]  # lane 0's last drafted token, and each guess; not block[:i] again
    monkeypatch.setattr(draft, "forward_rows", forward_rows)
    for index, (sequence, result) in enumerate(zip(sequences, results)):
        drafter.open(f"fresh-{index}", sequence, GREEDY, "model")
        assert result.proposal.token_ids == drafter.propose(f"fresh-{index}", len(sequence), [], 3).proposal.token_ids
        drafter.close(f"fresh-{index}")
    assert all(session.cached_len == 0 for session in replaced)  # a replaced cache gives its blocks back at once
    drafter.close("s")
    assert draft.kv_pool.blocks.used == used_before
