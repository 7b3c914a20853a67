"""The base_len sync invariant on the plain service objects: stale, retried and duplicated calls."""

from __future__ import annotations

import pytest

from draft_service.service import DraftService
from draft_service.settings import DraftSettings
from specdec.common.errors import StaleBaseLenError
from specdec.decoding.reference_loop import target_only_generate
from specdec.sampling.rules import SamplingParams
from verify_service.service import VerifyService
from verify_service.settings import VerifySettings

PROMPT = [4, 8, 15, 16, 23]
GREEDY = SamplingParams()


@pytest.fixture
def services(tiny_pair):
    target, draft = tiny_pair
    drafter = DraftService(DraftSettings(model=""), draft, draft.vocab_size)
    verifier = VerifyService(VerifySettings(), target)
    drafter.open("s", PROMPT, GREEDY, "model")
    verifier.open("s", PROMPT, GREEDY)
    return drafter, verifier


def session_tokens(service, session_id="s"):
    session = service.sessions.get(session_id)
    if hasattr(session, "lane"):  # the drafter's sessions hold lanes; these tests use lane 0
        session = session.lane(0)
    kv = getattr(session, "kv", None) or session.session
    assert kv.cached_len <= len(kv.tokens)
    return list(kv.tokens)


def test_stale_base_len_is_refused_with_our_length(services):
    drafter, verifier = services
    with pytest.raises(StaleBaseLenError) as raised:
        verifier.verify("s", len(PROMPT) + 3, [1], None)
    assert raised.value.session_len == len(PROMPT)
    with pytest.raises(StaleBaseLenError):
        drafter.propose("s", len(PROMPT) + 1, [], 2)
    assert session_tokens(verifier) == PROMPT and session_tokens(drafter) == PROMPT


def test_retried_verify_gives_the_same_verdict_and_cache(services):
    drafter, verifier = services
    proposal = drafter.propose("s", len(PROMPT), [], 4).proposal
    first, _, first_len = verifier.verify("s", len(PROMPT), proposal.token_ids, proposal.probs)
    after_first = session_tokens(verifier)
    again, _, again_len = verifier.verify("s", len(PROMPT), proposal.token_ids, proposal.probs)  # a retry
    assert (again, again_len) == (first, first_len)
    assert session_tokens(verifier) == after_first == PROMPT + first.tokens


def test_duplicated_propose_gives_the_same_block(services):
    drafter, _ = services
    one = drafter.propose("s", len(PROMPT), [], 4)
    two = drafter.propose("s", len(PROMPT), [], 4)
    assert one.proposal.token_ids == two.proposal.token_ids and one.session_len == two.session_len


def test_rounds_with_rollbacks_match_target_only(services, tiny_pair):
    """Drive both services round by round, as the coordinator does, duplicating every call once."""
    target, _ = tiny_pair
    drafter, verifier = services
    committed, synced = list(PROMPT), len(PROMPT)
    while len(committed) < len(PROMPT) + 20:
        for _ in range(2):  # the duplicate must not change anything
            proposal = drafter.propose("s", synced, committed[synced:], 3).proposal
        for _ in range(2):
            verdict, _, length = verifier.verify("s", len(committed), proposal.token_ids, proposal.probs)
        synced = len(committed) + verdict.num_accepted
        committed += verdict.tokens
        assert length == len(committed) and session_tokens(verifier) == committed
        assert session_tokens(drafter)[:synced] == committed[:synced]
    expected = target_only_generate(target, PROMPT, GREEDY, len(committed) - len(PROMPT)).token_ids
    generated = committed[len(PROMPT) :]
    cut = generated.index(0) + 1 if 0 in generated else len(generated)  # target-only stops at EOS (id 0)
    assert generated[:cut] == expected
