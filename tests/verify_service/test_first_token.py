"""An open that draws the session's first token from its prefill, as plain decoding's first step draws it."""

from __future__ import annotations

import pytest
from host_syncs import HostSyncCounter

from specdec.decoding.reference_loop import target_only_generate
from specdec.sampling.rules import SamplingParams, SamplingRule
from specdec.serving.wire import PLAIN_STEP
from verify_service.service import OPEN, VERIFY, GuessedRound, Opened, VerifyService
from verify_service.settings import VerifySettings

PROMPT = [4, 8, 15, 16, 23]
OTHER = [42, 7, 7, 1, 30, 2, 9, 11]
SETTINGS = {
    "greedy": SamplingParams(),
    "coupled, seeded": SamplingParams(temperature=1.0, seed=7, rule=SamplingRule.COUPLED),
    "rejection": SamplingParams(temperature=0.8, top_k=20, seed=3, rule=SamplingRule.REJECTION),
}


@pytest.fixture
def target(tiny_pair):
    return tiny_pair[0]


@pytest.mark.parametrize("name", SETTINGS)
def test_the_first_token_and_the_plain_rounds_after_it_are_plain_decodings(target, name):
    params = SETTINGS[name]
    plain = target_only_generate(target, PROMPT, params, 6).token_ids
    service = VerifyService(VerifySettings(), target)
    opened = service.open("s", PROMPT, params, draws_first_token=True)
    verdict, _, length = opened.first
    assert (verdict.tokens, length) == ([plain[0]], len(PROMPT) + 1)
    generated = [verdict.next_token]
    while len(generated) < len(plain):
        verdict, _, length = service.verify("s", length, [], None)
        generated.append(verdict.next_token)
    assert generated == plain


def test_a_block_after_the_first_token_feeds_it_with_the_drafted_tokens(target):
    plain = target_only_generate(target, PROMPT, SamplingParams(), 5).token_ids
    service = VerifyService(VerifySettings(), target)
    service.open("s", PROMPT, SamplingParams(), draws_first_token=True)
    verdict, timing, length = service.verify("s", len(PROMPT) + 1, plain[1:4], None)
    assert verdict.tokens == plain[1:5] and length == len(PROMPT) + 5
    assert timing.batch_tokens == 1 + 3  # the first token, then the draft


def test_first_tokens_ride_along_with_rounds_and_the_step_reads_the_host_once(target):
    service, apart = VerifyService(VerifySettings(), target), VerifyService(VerifySettings(), target)
    for verifier in (service, apart):
        verifier.open("a", PROMPT, SamplingParams())
    with HostSyncCounter() as syncs:
        results = service.step_many(
            [
                ("x", OPEN, OTHER, SETTINGS["coupled, seeded"], None, 0, True),  # no constraint, draws its first
                ("a", VERIFY, len(PROMPT), [17, 2], None),
                ("y", OPEN, OTHER[:3], SETTINGS["greedy"]),  # keeps its row for its first round
            ]
        )
    assert syncs.count == 1, syncs.reads
    assert isinstance(results[0], Opened) and results[2].first is None
    alone = apart.open("x", OTHER, SETTINGS["coupled, seeded"], draws_first_token=True)
    assert results[0].first[0] == alone.first[0] and results[0].first[2] == len(OTHER) + 1
    assert results[1][:1] == apart.verify("a", len(PROMPT), [17, 2], None)[:1]
    assert len(service.sessions.get("y")) == 3


def test_a_follow_up_of_the_open_runs_after_its_first_token(target):
    """A plain step handed over with VerifyNext after the open runs at once after its first token."""
    service = VerifyService(VerifySettings(), target)
    opened = service.open("s", PROMPT, SamplingParams(), draws_first_token=True)
    guess = GuessedRound(0, opened.first[0].next_token + 1, [3], None)  # a wrong guess of the first token
    choose = service.next_round_choice("s", len(PROMPT), [guess], plain_otherwise=True)
    assert choose(opened) == (PLAIN_STEP, ("s", VERIFY, len(PROMPT) + 1, [], None))
    assert service.next_round_choice("s", len(PROMPT), [guess], plain_otherwise=False)(opened) is None
    assert service.next_round_choice("s", len(PROMPT), [], True)(Opened(0)) is None  # no first token drawn
