"""Wire helpers: which verdicts a Verify caller's next-call hint names; constraints and penalties both ways."""

from __future__ import annotations

import pytest

from specdec.common.errors import InvalidFieldError
from specdec.sampling.constraints import ConstraintKind, ConstraintSpec
from specdec.sampling.rules import SamplingParams
from specdec.serving.wire import (
    constraint_from_proto,
    constraint_to_proto,
    ends_after,
    follows_at_once,
    sampling_from_proto,
    sampling_to_proto,
)
from specdec.v1 import common_pb2, verifier_pb2


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


@pytest.mark.parametrize(
    "spec",
    [
        ConstraintSpec(ConstraintKind.JSON_SCHEMA, '{"type": "integer"}'),
        ConstraintSpec(ConstraintKind.JSON_OBJECT),
        ConstraintSpec(ConstraintKind.REGEX, "[a-z]+"),
        ConstraintSpec(ConstraintKind.GRAMMAR, 'root ::= "a"'),
        ConstraintSpec(ConstraintKind.LARK, 'start: "a"'),
    ],
    ids=lambda spec: spec.kind.value,
)
def test_a_constraint_crosses_the_wire_unchanged(spec):
    assert constraint_from_proto(constraint_to_proto(spec)) == spec


def test_no_constraint_is_none_and_an_empty_source_is_named():
    assert constraint_from_proto(common_pb2.Constraint()) is None
    with pytest.raises(InvalidFieldError, match="constraint.regex"):
        constraint_from_proto(common_pb2.Constraint(regex=""))


def test_penalties_and_min_p_cross_the_wire_and_unset_repetition_is_off():
    params = SamplingParams(  # values float32 holds exactly
        0.75, 5, 0.875, 3, repetition_penalty=1.25, frequency_penalty=-0.5, presence_penalty=0.25, min_p=0.125
    )
    assert sampling_from_proto(sampling_to_proto(params)) == params
    assert sampling_from_proto(common_pb2.SamplingParams(temperature=1.0)).repetition_penalty == 1.0
    with pytest.raises(InvalidFieldError, match="sampling.presence_penalty"):
        sampling_from_proto(common_pb2.SamplingParams(presence_penalty=2.5))
