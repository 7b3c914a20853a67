"""A verify-service step that opens new sessions and runs other sessions' rounds in one packed pass."""

from __future__ import annotations

import pytest
import torch

from specdec.common.errors import InvalidFieldError, StaleBaseLenError
from specdec.sampling.rules import SamplingParams
from verify_service.service import LAST_VERIFY, OPEN, VERIFY, Opened, VerifyService
from verify_service.settings import VerifySettings

GREEDY = SamplingParams()
PROMPTS = {"a": [4, 8, 15, 16, 23], "b": [42, 7, 7, 1, 30, 2, 9, 11], "c": [3, 5]}
DRAFTS = {"a": [17, 2, 40], "b": [9]}
NEW = {"x": [5, 6, 7, 8, 9, 10, 11, 12, 13], "y": [60, 61]}


def tokens(service: VerifyService, session_id: str) -> list[int]:
    return list(service.sessions.get(session_id).kv.tokens)


def logits_after(service: VerifyService, session_id: str) -> torch.Tensor:
    """Scores the session's last token: [1, V], from its cache (so a wrong prefill shows)."""
    return service.sessions.get(session_id).kv.extend([])


@pytest.fixture
def target(tiny_pair):
    return tiny_pair[0]


def test_opens_ride_along_with_rounds_and_change_nothing(target):
    mixed, apart = VerifyService(VerifySettings(), target), VerifyService(VerifySettings(), target)
    for service in (mixed, apart):
        for session_id in ("a", "b"):
            service.open(session_id, PROMPTS[session_id], GREEDY)
    results = mixed.step_many(
        [
            ("x", OPEN, NEW["x"], GREEDY),
            ("a", VERIFY, len(PROMPTS["a"]), DRAFTS["a"], None),
            ("y", OPEN, NEW["y"], GREEDY),
            ("b", VERIFY, len(PROMPTS["b"]), DRAFTS["b"], None),
        ]
    )
    alone = [apart.verify(session_id, len(PROMPTS[session_id]), DRAFTS[session_id], None) for session_id in "ab"]
    for session_id in "xy":
        apart.open(session_id, NEW[session_id], GREEDY)

    assert all(isinstance(results[i], Opened) and results[i].first is None for i in (0, 2))  # no first token asked
    for (verdict, timing, length), (verdict_alone, _, length_alone) in zip((results[1], results[3]), alone):
        assert (verdict, length) == (verdict_alone, length_alone)
        assert timing.batch_rows == 2  # the two rounds share the pass with the prefills
        assert timing.batch_tokens == (len(DRAFTS["a"]) + 1) + (len(DRAFTS["b"]) + 1) + (9 - 1) + (2 - 1)
    for session_id in "abxy":
        assert tokens(mixed, session_id) == tokens(apart, session_id)
        torch.testing.assert_close(
            logits_after(mixed, session_id), logits_after(apart, session_id), rtol=1e-4, atol=1e-4
        )


def test_a_failing_call_fails_alone_in_a_mixed_step(target):
    service = VerifyService(VerifySettings(max_speculative_tokens=2), target)
    service.open("a", PROMPTS["a"], GREEDY)
    results = service.step_many(
        [
            ("a", VERIFY, len(PROMPTS["a"]), [1, 2, 3], None),
            ("c", OPEN, PROMPTS["c"], GREEDY),
            ("missing", VERIFY, 3, [1], None),
        ]
    )
    assert isinstance(results[0], InvalidFieldError) and results[0].field == "draft_token_ids"
    assert isinstance(results[1], Opened) and tokens(service, "c") == PROMPTS["c"]
    assert isinstance(results[2], Exception)
    with pytest.raises(ValueError, match="step calls"):
        service.step_many([("a", "close")])


def test_each_scoring_pass_is_reported_with_its_prefill_and_scored_tokens(target):
    passes = []
    service = VerifyService(VerifySettings(), target, on_pass=lambda *reported: passes.append(reported))
    service.open("a", PROMPTS["a"], GREEDY)
    service.step_many([("x", OPEN, NEW["x"], GREEDY), ("a", VERIFY, len(PROMPTS["a"]), DRAFTS["a"], None)])
    service.verify("a", len(tokens(service, "a")), [], None)
    with pytest.raises(StaleBaseLenError):  # a round that fails before the pass: no pass runs, none is reported
        service.verify("a", len(tokens(service, "a")) + 5, [1], None)

    assert [(prefill, scored) for _, prefill, scored in passes] == [
        (len(PROMPTS["a"]), 0),  # the open alone: every prompt token, the last one's row kept
        (len(NEW["x"]), len(DRAFTS["a"])),  # an open riding along with a first round of γ = 3 (after the kept row)
        (0, 1),
    ]  # a plain step
    assert all(ns > 0 for ns, _, _ in passes)


def test_greedy_decoding_is_marked_from_the_second_plain_round_but_not_on_a_requests_last(target):
    """The mark lets a model process run the next pass ahead (specdec/engine/model_worker.py); after a request's last
    round no pass follows, so none is marked."""
    service = VerifyService(VerifySettings(), target)
    service.open("a", PROMPTS["a"], GREEDY)
    marks = []
    for kind in (VERIFY, VERIFY, VERIFY, LAST_VERIFY):
        [(_, _, length)] = service.step_many([("a", kind, len(service.sessions.get("a")), [], None)])
        assert length == len(service.sessions.get("a"))
        marks.append(service.sessions.get("a").kv.cache.decodes_greedily)
    assert marks == [False, True, True, False]
    [(_, _, _)] = service.step_many([("a", VERIFY, len(service.sessions.get("a")), DRAFTS["a"], None)])
    assert not service.sessions.get("a").kv.cache.decodes_greedily  # a speculative round
