"""Choosing every drafting session's next token at once: the one-row reference's tokens and q, one host read."""

from __future__ import annotations

import math
import random

import pytest
import torch
from host_syncs import HostSyncCounter
from scipy.stats import chisquare

from specdec.decoding.drafting import DraftJob, DraftRun, next_tokens
from specdec.engine.kv.session import KVSession, run_forwards
from specdec.engine.model_runtime import LoadedModel, ModelSettings
from specdec.sampling.draft_sampler import RowRequest, choose_rows
from specdec.sampling.rules import (
    NonFiniteLogitsError,
    SamplingParams,
    SamplingRule,
    Stream,
    coupled_scores,
    logits_to_probs,
    sample_token,
)

VOCAB = 24
MIN_P_VALUE = 0.001


def one_by_one(logits: torch.Tensor, request: RowRequest) -> tuple[int, torch.Tensor | None, list[int], torch.Tensor]:
    """The one-row reference for logits [V]: (token, q kept or None, alternatives, what they are ranked by [V]);
    the alternatives are among the allowed tokens (a finite logit) only."""
    params, width = request.params, min(request.num_alternatives + 1, logits.shape[-1])
    probs = logits_to_probs(logits, params)  # [V]
    if params.coupled:
        ranking = coupled_scores(probs[None], [(params.seed, request.position)])[0]  # [V]
        token, kept = int(ranking.argmax()), None
        ranking = ranking.double().masked_fill(logits == -math.inf, -math.inf)
    else:
        ranking = logits.double()
        token = sample_token(probs, params, position=request.position, stream=Stream.DRAFT)
        kept = None if params.greedy else probs
    ranked = ranking.topk(width).indices.tolist() if request.num_alternatives else []
    ranked = [t for t in ranked if logits[t] != -math.inf]  # a refused token is no verdict's: never an alternative
    return token, kept, [t for t in ranked if t != token][: request.num_alternatives], ranking


def random_request(rng: random.Random) -> RowRequest:
    params = SamplingParams(
        temperature=rng.choice([0.0, 0.0, 1e-3, 0.5, 1.0, 1.7]),
        top_k=rng.choice([0, 0, 1, 3, 8, VOCAB + 5]),
        top_p=rng.choice([1.0, 1.0, 0.9, 0.5, 0.05]),
        seed=rng.randrange(2**64),
        rule=rng.choice(list(SamplingRule)),
    )
    return RowRequest(params, rng.randrange(10_000), rng.choice([0, 0, 1, 2, 5]))


def random_logits(rng: random.Random, generator: torch.Generator) -> torch.Tensor:
    """A row [V]: scaled normal logits, some with -inf masks, some with ties at the top."""
    logits = torch.randn(VOCAB, generator=generator) * rng.choice([0.3, 1.0, 4.0])
    if rng.random() < 0.3:
        logits[torch.randperm(VOCAB, generator=generator)[: rng.randrange(1, VOCAB)]] = -math.inf
    if rng.random() < 0.2:
        logits[rng.sample(range(VOCAB), 2)] = logits.max() + 1.0
    return logits


@pytest.mark.parametrize("seed", range(6))
def test_rows_together_draw_what_one_by_one_draws(seed: int):
    rng, generator = random.Random(seed), torch.Generator().manual_seed(seed)
    requests = [random_request(rng) for _ in range(40)]
    logits = torch.stack([random_logits(rng, generator) for _ in requests])  # [K, V]
    for row, (choice, request) in enumerate(zip(choose_rows(logits, requests), requests)):
        token, kept, alternatives, ranking = one_by_one(logits[row], request)
        assert choice.bad_logits == 0 and choice.token == token, (row, request)
        if kept is None:
            assert choice.probs is None
        else:
            assert torch.equal(choice.probs, kept)
        chosen = [t for t in choice.ranked if t != choice.token][: request.num_alternatives]
        assert ranking[chosen].tolist() == ranking[alternatives].tolist()  # equal values: ties may swap places


def test_jobs_together_draft_what_one_by_one_drafts(tiny_pair):
    """Two steps of 30 mixed jobs: each job's tokens, alternatives and stacked q [γ, V] are the reference's."""
    _, draft = tiny_pair
    rng, generator = random.Random(99), torch.Generator().manual_seed(99)
    jobs = []
    for _ in range(30):
        request = random_request(rng)
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 40))]
        jobs.append(DraftJob(KVSession(draft, prompt), 2, request.params, request.num_alternatives))
    expected = [[] for _ in jobs]  # per job and step: the reference's (token, q kept, alternatives, ranking)
    for step in range(2):
        logits = torch.stack([random_logits(rng, generator) for _ in jobs])  # [K, V]
        for job, row, steps in zip(jobs, logits, expected):
            steps.append(one_by_one(row, RowRequest(job.params, len(job.session), job.num_alternatives)))
        assert next_tokens(jobs, logits) == [steps[step][0] for steps in expected]
        for job in jobs:
            job.session.append(job.tokens[-1:])
    for job, steps in zip(jobs, expected):
        drafted = job.result()
        assert drafted.token_ids == [token for token, _, _, _ in steps]
        rows = [kept for _, kept, _, _ in steps if kept is not None]
        assert drafted.probs is None if not rows else torch.equal(drafted.probs, torch.stack(rows))
        for chosen, (_, _, alternatives, ranking) in zip(drafted.alternatives, steps):
            assert ranking[chosen].tolist() == ranking[alternatives].tolist()  # equal values: ties may swap places
        assert len(drafted.alternatives) == (2 if job.num_alternatives else 0)


@pytest.mark.parametrize("rule", list(SamplingRule))
def test_a_bad_row_fails_alone(tiny_pair, rule: SamplingRule):
    _, draft = tiny_pair
    sampled = SamplingParams(temperature=0.9, top_p=0.8, seed=7, rule=rule)
    rows = [  # [V = 5] each
        torch.tensor([0.1, float("nan"), 0.3, 0.0, 0.2]),
        torch.tensor([0.5, 2.0, -1.0, 0.0, 1.0]),
        torch.tensor([0.0, math.inf, 1.0, 0.0, 0.0]),
        torch.tensor([-math.inf] * 5),
        torch.tensor([1.0, 0.0, -math.inf, 3.0, 2.0]),
    ]
    params = [sampled, sampled, SamplingParams(), sampled, SamplingParams()]
    jobs = [DraftJob(KVSession(draft, [1, 2, 3]), 2, p, 2) for p in params]
    tokens = next_tokens(jobs, torch.stack(rows))
    messages = {
        0: "logits contain NaN or +inf",
        2: "logits contain NaN or +inf",
        3: "a row of logits is all -inf, so no token is possible",
    }
    for index, (job, logits) in enumerate(zip(jobs, rows)):
        if index in messages:
            assert isinstance(tokens[index], NonFiniteLogitsError) and str(tokens[index]) == messages[index]
            assert job.tokens == [] and job.rows == [] and job.alternatives == []
            with pytest.raises(NonFiniteLogitsError, match="logits"):  # as the one-row reference does
                one_by_one(logits, RowRequest(job.params, 3, 2))
            continue
        token, kept, alternatives, _ = one_by_one(logits, RowRequest(job.params, 3, 2))
        assert (tokens[index], job.alternatives) == (token, [alternatives])
        assert job.rows == [] if kept is None else torch.equal(job.rows[0], kept)


@pytest.mark.parametrize("rule", list(SamplingRule))
def test_batched_draws_follow_q(rule: SamplingRule):
    """Many seeds in one batch at one position: the drawn tokens pass a chi-square test against q."""
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.7, -math.inf, 0.0, 1.5])
    params = [SamplingParams(temperature=1.3, top_p=0.95, seed=seed, rule=rule) for seed in range(4000)]
    q = logits_to_probs(logits, params[0])  # [V]
    choices = choose_rows(logits.expand(len(params), -1), [RowRequest(p, 17, 0) for p in params])
    counts = torch.bincount(torch.tensor([c.token for c in choices]), minlength=q.shape[0]).double()  # [V]
    support = q > 0
    assert counts[~support].sum() == 0, f"zero-probability tokens drawn: {counts.tolist()}"
    expected = q[support].double() / q[support].double().sum() * counts.sum()
    result = chisquare(counts[support].numpy(), expected.numpy())
    assert result.pvalue > MIN_P_VALUE, f"counts {counts.tolist()} vs q {q.tolist()}: {result}"


@pytest.fixture(scope="module")
def packed_draft(tiny_pair_dirs) -> LoadedModel:
    return LoadedModel.load(ModelSettings(str(tiny_pair_dirs[1])))


MIXED = [
    (SamplingParams(), 0),
    (SamplingParams(temperature=0.8, top_k=10, seed=3), 0),
    (SamplingParams(temperature=1.1, top_p=0.9, seed=4, rule=SamplingRule.COUPLED), 2),
    (SamplingParams(), 3),
    (SamplingParams(temperature=0.6, seed=5), 1),
    (SamplingParams(temperature=1.0, seed=6, rule=SamplingRule.COUPLED), 0),
]


@pytest.mark.parametrize("num_sessions", [1, 4, 9])
def test_a_draft_step_reads_the_host_once(packed_draft: LoadedModel, num_sessions: int):
    """Each DraftRun.step (the packed pass included) reads back once, whatever the rows and their rules."""
    sessions = [KVSession(packed_draft, [1 + i, 5, 9, 2 + i % 3]) for i in range(num_sessions)]
    run_forwards([session.plan_prefill() for session in sessions])
    run = DraftRun()
    for index, session in enumerate(sessions):
        params, alternatives = MIXED[index % len(MIXED)]
        assert run.add(index, session, 3, params, alternatives) is None
    outcomes = {}
    while run:
        with HostSyncCounter() as syncs:
            finished = run.step()
        assert syncs.reads == ["tolist"]
        outcomes.update(finished)
    assert sorted(outcomes) == list(range(num_sessions))
    assert all(len(drafted.token_ids) == 3 for drafted in outcomes.values())
