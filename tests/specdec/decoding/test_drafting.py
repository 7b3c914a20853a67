"""Choosing drafted tokens for a batch of sessions: every row together, as one by one would."""

from __future__ import annotations

import math

import torch

from specdec.decoding.drafting import DraftJob, draft_with_model, next_tokens
from specdec.engine.kv.session import KVSession
from specdec.sampling.rules import (
    NonFiniteLogitsError,
    SamplingParams,
    SamplingRule,
    coupled_scores,
    logits_to_probs,
    sample_token,
)

GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=1.0, seed=11)
INF = math.inf
LOGITS = [  # [V = 6] rows, hand-made
    torch.tensor([0.1, 2.0, 2.0, -1.0, 0.5, 1.9]),  # a tie at the top: the first index wins
    torch.tensor([3.0, -INF, 0.0, 1.0, 2.0, -2.0]),
    torch.tensor([0.0, float("nan"), 1.0, 0.0, 0.0, 0.0]),  # fails alone
    torch.tensor([-INF] * 6),  # no token allowed: fails alone
    torch.tensor([0.3, 0.1, 0.2, 0.0, 0.4, 0.5]),  # sampled
    torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0, 0.0]),  # greedy, no alternatives asked
]
PARAMS = [GREEDY, GREEDY, GREEDY, GREEDY, SAMPLED, GREEDY]
ALTERNATIVES = [3, 2, 2, 1, 2, 0]


def jobs(tiny_pair) -> list[DraftJob]:
    _, draft = tiny_pair
    return [
        DraftJob(KVSession(draft, [1, 2, 3]), 4, params, alternatives)
        for params, alternatives in zip(PARAMS, ALTERNATIVES)
    ]


def test_rows_together_pick_what_one_by_one_picks(tiny_pair):
    batched = jobs(tiny_pair)
    tokens = next_tokens(batched, torch.stack(LOGITS))
    for index, message in (
        (2, "logits contain NaN or +inf"),
        (3, "a row of logits is all -inf, so no token is possible"),
    ):
        assert isinstance(tokens[index], NonFiniteLogitsError) and str(tokens[index]) == message
        assert batched[index].tokens == []
    q = logits_to_probs(LOGITS[4], SAMPLED)
    sampled = sample_token(q, SAMPLED, position=3)  # position 3: after [1, 2, 3]
    assert [tokens[i] for i in (0, 1, 4, 5)] == [1, 0, sampled, 0]
    assert batched[0].alternatives == [[2, 5, 4]] and batched[1].alternatives == [[4, 3]]
    ranked = LOGITS[4].topk(3).indices.tolist()
    assert batched[4].alternatives == [[t for t in ranked if t != sampled][:2]] and batched[5].alternatives == []
    assert batched[0].result().probs is None  # greedy: q is one-hot, not sent
    assert torch.equal(batched[4].result().probs, q[None])  # sampled: the q row [1, V] it was drawn from


def test_greedy_rows_without_alternatives_pick_the_first_largest(tiny_pair):
    """No alternatives asked: the first index of each row's largest logit."""
    _, draft = tiny_pair
    rows = [LOGITS[0], LOGITS[1], LOGITS[3], LOGITS[5]]
    batched = [DraftJob(KVSession(draft, [1, 2, 3]), 4, GREEDY, 0) for _ in rows]
    tokens = next_tokens(batched, torch.stack(rows))
    assert tokens[:2] == [1, 0] and tokens[3] == 0
    assert isinstance(tokens[2], NonFiniteLogitsError)
    assert all(job.alternatives == [] for job in batched)


def test_a_coupled_draft_keeps_no_q_and_ranks_alternatives_by_the_perturbed_scores(tiny_pair):
    """Under the coupled rule the drafted token is argmax(log q + g) of its position, no q row is kept (the
    verifier needs none, so none is sent), and the alternatives are the runners-up of log q + g."""
    _, draft = tiny_pair
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=5, rule=SamplingRule.COUPLED)
    job = DraftJob(KVSession(draft, [1, 2, 3]), 4, params, 2)
    logits = LOGITS[4]
    (token,) = next_tokens([job], logits[None])
    scores = coupled_scores(logits_to_probs(logits, params)[None], [(params.seed, 3)])[0]  # position 3: after [1, 2, 3]
    ranked = scores.topk(3).indices.tolist()
    assert token == ranked[0] and job.alternatives == [ranked[1:]]
    assert job.result().probs is None

    drafted = draft_with_model(KVSession(draft, [4, 5, 6, 7]), 5, params, num_alternatives=2)
    assert len(drafted.token_ids) == 5 and drafted.probs is None
    for token, others in zip(drafted.token_ids, drafted.alternatives):
        assert len(others) == 2 and token not in others
