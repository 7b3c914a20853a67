"""VerifyNext over a real verify service: the next round, handed over while the round before it is verified,
runs on the candidate its verdict selects (or a plain step, or nothing) and commits what a Verify would."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import grpc
import pytest

from specdec.decoding.reference_loop import target_only_generate
from specdec.local_stack import start_service
from specdec.sampling.rules import SamplingParams
from specdec.serving.wire import sampling_to_proto
from specdec.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc

PROMPT = [5, 9, 14, 3]
AHEAD = 12  # greedy reference tokens needed


@pytest.fixture(scope="module")
def verifier(tiny_pair_dirs):
    target_dir, _ = tiny_pair_dirs
    service = start_service(
        "verify", "verify_service", ["--model", str(target_dir)], Path(tempfile.mkdtemp(prefix="verify-next-"))
    )
    with grpc.insecure_channel(service.address) as channel:
        yield verifier_pb2_grpc.VerifierStub(channel)
    service.stop()


@pytest.fixture(scope="module")
def reference(tiny_pair) -> list[int]:
    """The target's greedy continuation of PROMPT."""
    target, _ = tiny_pair
    return target_only_generate(target, PROMPT, SamplingParams(), AHEAD).token_ids


def open_session(verifier, session_id: str) -> None:
    verifier.OpenSession(
        verifier_pb2.OpenVerifySessionRequest(
            session_id=session_id, prompt_token_ids=PROMPT, sampling=sampling_to_proto(SamplingParams())
        ),
        timeout=30,
    )


def round_after(num_accepted: int, next_token: int, drafts: list[int]) -> verifier_pb2.GuessedRound:
    return verifier_pb2.GuessedRound(
        verdict=verifier_pb2.GuessedVerdict(num_accepted=num_accepted, next_token_id=next_token), draft_token_ids=drafts
    )


def verify_then_next(
    verifier,
    session_id: str,
    block: list[int],
    rounds: list[verifier_pb2.GuessedRound],
    plain_otherwise: bool = False,
    after_base_len: int = len(PROMPT),
):
    """Verify(block) and, while it runs, VerifyNext(rounds): (its verdict, VerifyNext's answer)."""
    verdict = verifier.Verify.future(
        verifier_pb2.VerifyRequest(session_id=session_id, base_len=len(PROMPT), draft_token_ids=block), timeout=30
    )
    following = verifier.VerifyNext(
        verifier_pb2.VerifyNextRequest(
            session_id=session_id, after_base_len=after_base_len, rounds=rounds, plain_otherwise=plain_otherwise
        ),
        timeout=30,
    )
    return verdict.result(), following


def test_the_round_of_the_matching_guess_runs_and_commits(verifier, reference):
    open_session(verifier, "hit")
    verdict, following = verify_then_next(
        verifier,
        "hit",
        reference[:3],
        [
            round_after(1, (reference[1] + 1) % 64, [1, 2]),  # a guessed rejection that does not happen
            round_after(3, reference[3], reference[4:7]),  # "all accepted", bonus reference[3]
        ],
    )
    assert list(verdict.accepted_token_ids) == reference[:3] and verdict.next_token_id == reference[3]
    assert following.ran and following.round_index == 1
    assert list(following.verdict.accepted_token_ids) == reference[4:7]
    assert following.verdict.next_token_id == reference[7]
    assert following.verdict.session_len == len(PROMPT) + 8
    after = verifier.Verify(verifier_pb2.VerifyRequest(session_id="hit", base_len=len(PROMPT) + 8), timeout=30)
    assert after.next_token_id == reference[8]  # the session goes on from what VerifyNext committed


def test_a_verify_next_that_overtakes_its_round_waits_for_it(verifier, reference):
    open_session(verifier, "early")
    following = verifier.VerifyNext.future(
        verifier_pb2.VerifyNextRequest(
            session_id="early", after_base_len=len(PROMPT), rounds=[round_after(3, reference[3], reference[4:7])]
        ),
        timeout=30,
    )
    time.sleep(0.2)  # it reached the verifier before the round it follows
    verdict = verifier.Verify(
        verifier_pb2.VerifyRequest(session_id="early", base_len=len(PROMPT), draft_token_ids=reference[:3]), timeout=30
    )
    assert verdict.next_token_id == reference[3]
    answer = following.result()
    assert answer.ran and answer.round_index == 0 and answer.verdict.next_token_id == reference[7]


def test_a_verdict_no_guess_matches_runs_a_plain_step_or_nothing(verifier, reference):
    wrong = (reference[1] + 1) % 64
    guessed = [round_after(3, reference[3], reference[4:7])]
    open_session(verifier, "plain")
    verdict, following = verify_then_next(verifier, "plain", [reference[0], wrong, 7], guessed, plain_otherwise=True)
    assert list(verdict.accepted_token_ids) == reference[:1] and verdict.next_token_id == reference[1]
    assert following.ran and following.round_index == -1
    assert not following.verdict.accepted_token_ids and following.verdict.next_token_id == reference[2]

    open_session(verifier, "nothing")
    _, following = verify_then_next(verifier, "nothing", [reference[0], wrong, 7], guessed)
    assert not following.ran


def test_a_round_that_follows_another_base_len_runs_nothing(verifier, reference):
    open_session(verifier, "stale")
    _, following = verify_then_next(
        verifier,
        "stale",
        reference[:3],
        [round_after(3, reference[3], [1])],
        plain_otherwise=True,
        after_base_len=len(PROMPT) + 1,
    )
    assert not following.ran
    again = verifier.Verify(verifier_pb2.VerifyRequest(session_id="stale", base_len=len(PROMPT) + 4), timeout=30)
    assert again.next_token_id == reference[4]  # nothing was committed past the verdict


@pytest.mark.parametrize(
    "guessed, code, field",
    [
        (
            verifier_pb2.GuessedRound(verdict=verifier_pb2.GuessedVerdict(num_accepted=1), draft_token_ids=[1]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "rounds[0].verdict.next_token_id",
        ),
        (round_after(1, 64, [1]), grpc.StatusCode.INVALID_ARGUMENT, "rounds[0].verdict.next_token_id"),
        (round_after(1, 2, []), grpc.StatusCode.INVALID_ARGUMENT, "rounds[0].draft_token_ids"),
        (round_after(1, 2, [1, 99]), grpc.StatusCode.INVALID_ARGUMENT, "rounds[0].draft_token_ids"),
        (round_after(1, 2, [1] * 40), grpc.StatusCode.INVALID_ARGUMENT, "rounds[0].draft_token_ids"),
    ],
)
def test_bad_rounds_are_invalid_argument_naming_the_field(verifier, guessed, code, field):
    with pytest.raises(grpc.RpcError) as raised:
        verifier.VerifyNext(
            verifier_pb2.VerifyNextRequest(session_id="any", after_base_len=4, rounds=[guessed]), timeout=30
        )
    assert raised.value.code() == code and raised.value.details().startswith(field), raised.value.details()


def test_an_unknown_session_is_not_found(verifier):
    with pytest.raises(grpc.RpcError) as raised:
        verifier.VerifyNext(
            verifier_pb2.VerifyNextRequest(session_id="nope", after_base_len=4, plain_otherwise=True), timeout=30
        )
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND and "session_id" in raised.value.details()
    info = verifier.Info(common_pb2.InfoRequest(), timeout=10)
    assert info.active_sessions >= 0  # still serving
