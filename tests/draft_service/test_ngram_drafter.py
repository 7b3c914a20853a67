"""Prompt-lookup drafter: match selection, caps, rollback and settings validation."""

from __future__ import annotations

import random

import pytest

from draft_service.ngram_drafter import NgramDraftSession, NgramSettings


def _session(prompt: list[int], **settings: int) -> NgramDraftSession:
    return NgramDraftSession(prompt, NgramSettings(**settings))


def _brute_force(tokens: list[int], settings: NgramSettings, num_tokens: int) -> list[int]:
    """Reference: scan backwards for the most recent earlier copy of the longest suffix."""
    limit = min(num_tokens, settings.max_proposal)
    for n in range(min(settings.max_ngram, len(tokens)), settings.min_ngram - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for end in range(len(tokens) - 1, n - 1, -1):
            if tokens[end - n : end] == suffix:
                return tokens[end : end + limit]
    return []


def test_longest_match_wins_over_more_recent_shorter_match() -> None:
    # Suffix [1, 2]: the 2-gram occurs at the start (followed by 3); only the 1-gram [2] occurs later (followed by 9).
    session = _session([1, 2, 3, 4, 2, 9, 1, 2], max_proposal=2)
    assert session.propose(5).token_ids == [3, 4]


def test_most_recent_match_wins_among_equal_lengths() -> None:
    session = _session([7, 5, 1, 7, 6, 2, 7], max_ngram=1)
    assert session.propose(1).token_ids == [6]


def test_no_match_gives_empty_proposal() -> None:
    session = _session([1, 2, 3, 4])
    proposal = session.propose(4)
    assert proposal.token_ids == [] and proposal.probs is None
    assert session.token_ids == [1, 2, 3, 4]


def test_match_near_end_gives_short_proposal() -> None:
    # The earlier [5] is followed only by [6, 5] before the sequence ends.
    session = _session([1, 5, 6, 5], max_ngram=2)
    assert session.propose(10).token_ids == [6, 5]


def test_caps_by_max_proposal_and_num_tokens() -> None:
    prompt = list(range(10)) + [0]
    assert _session(prompt, max_proposal=3).propose(8).token_ids == [1, 2, 3]
    assert _session(prompt, max_proposal=8).propose(2).token_ids == [1, 2]
    assert _session(prompt).propose(0).token_ids == []


def test_min_ngram_excludes_shorter_matches() -> None:
    assert _session([3, 4, 9, 4], min_ngram=2).propose(3).token_ids == []


def test_proposal_is_appended_and_probs_none() -> None:
    session = _session([1, 2, 3, 1])
    proposal = session.propose(2)
    assert proposal.token_ids == [2, 3] and proposal.probs is None
    assert session.token_ids == [1, 2, 3, 1, 2, 3]
    assert len(session) == 6 and session.kv_cache_tokens == 0


def test_truncate_then_propose_matches_fresh_session() -> None:
    rng = random.Random(0)
    settings = NgramSettings(min_ngram=1, max_ngram=3, max_proposal=4)
    for _ in range(30):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        session = NgramDraftSession(tokens, settings)
        session.propose(4)
        session.append([rng.randrange(4) for _ in range(3)])
        cut = rng.randrange(len(tokens) + 1)
        session.truncate(cut)
        session.append(tokens[cut : cut + 2])
        fresh = NgramDraftSession(tokens[:cut] + tokens[cut : cut + 2], settings)
        assert session.token_ids == fresh.token_ids
        assert session.propose(4) == fresh.propose(4)
        assert session.token_ids == fresh.token_ids


def test_matches_brute_force_reference() -> None:
    rng = random.Random(1)
    settings = NgramSettings(min_ngram=2, max_ngram=4, max_proposal=5)
    for _ in range(50):
        session = NgramDraftSession([rng.randrange(3) for _ in range(rng.randrange(0, 30))], settings)
        for _ in range(3):
            expected = _brute_force(session.token_ids, settings, 4)
            assert session.propose(4).token_ids == expected
            session.append([rng.randrange(3)])


def test_truncate_out_of_range_raises() -> None:
    with pytest.raises(ValueError, match="truncate"):
        _session([1, 2]).truncate(3)


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"min_ngram": 0}, "min_ngram"),
        ({"min_ngram": 3, "max_ngram": 2}, "max_ngram"),
        ({"max_proposal": 0}, "max_proposal"),
    ],
)
def test_settings_validation_names_field(fields: dict[str, int], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        NgramSettings(**fields).validate()
    with pytest.raises(ValueError, match=name):
        NgramDraftSession([1], NgramSettings(**fields))
