"""Wire helpers: which verdicts a Verify caller's next-call hint names."""

from __future__ import annotations

from specdec.serving.wire import ends_after, follows_at_once
from specdec.v1 import verifier_pb2


def test_a_hint_names_verdicts_by_accepted_count_and_token_or_any_token():
    hint = verifier_pb2.NextCallHint(
        after_verdicts=[
            verifier_pb2.GuessedVerdict(num_accepted=4),  # all accepted, whatever the bonus token
            verifier_pb2.GuessedVerdict(num_accepted=1, next_token_id=7),
        ]
    )
    assert follows_at_once(hint, 4, 123)
    assert follows_at_once(hint, 1, 7)
    assert not follows_at_once(hint, 1, 8)
    assert not follows_at_once(hint, 0, 7)


def test_after_any_verdict_and_the_empty_hint():
    assert follows_at_once(verifier_pb2.NextCallHint(after_any_verdict=True), 0, 5)
    assert not follows_at_once(verifier_pb2.NextCallHint(), 0, 5)


def test_only_a_hint_naming_nothing_says_the_request_ends():
    assert ends_after(verifier_pb2.NextCallHint())
    assert not ends_after(verifier_pb2.NextCallHint(after_any_verdict=True))
    assert not ends_after(verifier_pb2.NextCallHint(after_verdicts=[verifier_pb2.GuessedVerdict(num_accepted=0)]))
