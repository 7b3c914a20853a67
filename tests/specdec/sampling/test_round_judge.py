"""Tests for specdec.sampling.round_judge: every round's verdict equals sample_verdict's, and a step reads the device
once."""

from __future__ import annotations

import math
import random

import pytest
import torch
from host_syncs import HostSyncCounter
from scipy.stats import chisquare

from specdec.decoding.verification import VerifyJob, verify_rounds
from specdec.engine.kv.session import KVSession, run_forwards
from specdec.engine.model_runtime import LoadedModel, ModelSettings
from specdec.sampling.round_judge import DraftRound, judge_rounds
from specdec.sampling.rules import (
    NonFiniteLogitsError,
    SamplingParams,
    SamplingRule,
    Verdict,
    logits_to_probs,
    sample_verdict,
)

MIN_P_VALUE = 0.001


def reference(round_: DraftRound, logits: torch.Tensor) -> Verdict | Exception:
    """The verdict the one-round code gives, or its error."""
    try:
        p = logits_to_probs(logits, round_.params)
        return sample_verdict(round_.draft_tokens, round_.draft_probs, p, round_.params, round_.start_position)
    except ValueError as error:
        return error


def assert_same_outcomes(rounds: list[DraftRound], logits: list[torch.Tensor]) -> list[Verdict | Exception]:
    """The judge's outcome of each round equals the reference's: the same verdict, or an error of the same class
    (and, for bad logits, the same message)."""
    outcomes = judge_rounds(rounds, logits)
    for index, (round_, round_logits, outcome) in enumerate(zip(rounds, logits, outcomes)):
        expected = reference(round_, round_logits)
        if isinstance(expected, Exception):
            assert type(outcome) is type(expected), (index, outcome, expected)
            if isinstance(expected, NonFiniteLogitsError):
                assert str(outcome) == str(expected)
        else:
            assert outcome == expected, (index, round_, outcome, expected)
    return outcomes


def random_params(rng: random.Random, vocab: int) -> SamplingParams:
    """Greedy, rejection or coupled, with assorted temperatures (a tiny one too), top-k and top-p."""
    return SamplingParams(
        temperature=rng.choice([0.0, 0.0, 1e-6, 0.3, 0.7, 1.0, 1.0, 1.5]),
        top_k=rng.choice([0, 0, 1, 3, 10, vocab, vocab + 5]),
        top_p=rng.choice([1.0, 1.0, 0.95, 0.6, 0.2]),
        seed=rng.randrange(2**64),
        rule=rng.choice([SamplingRule.REJECTION, SamplingRule.REJECTION, SamplingRule.COUPLED]),
    )


def random_round(rng: random.Random, generator: torch.Generator, vocab: int) -> tuple[DraftRound, torch.Tensor]:
    """A round whose draft is sometimes the target's argmax (long greedy accepts), sometimes drawn from a q near p
    (long sampled accepts), sometimes arbitrary (early rejections)."""
    gamma = rng.randint(0, 8)
    logits = torch.randn(gamma + 1, vocab, generator=generator) * rng.choice([0.5, 1.5, 4.0])  # [γ+1, V]
    if rng.random() < 0.2:
        logits[torch.rand(gamma + 1, vocab, generator=generator) < 0.3] = -math.inf  # masked tokens
        logits[:, 0] = 0.0  # every row allows a token
    q_logits = logits[:gamma].clamp(min=-30) + torch.randn(gamma, vocab, generator=generator) * rng.choice([0.1, 1.0])
    q = q_logits.softmax(dim=-1)  # [γ, V]
    style = rng.choice(["argmax", "from q", "any"])
    if style == "argmax":
        draft = logits[:gamma].argmax(dim=-1).tolist()
    elif style == "from q":
        draft = torch.multinomial(q, 1, generator=generator).view(gamma).tolist() if gamma else []
    else:
        draft = [rng.randrange(vocab) for _ in range(gamma)]
    if gamma and rng.random() < 0.3:
        q[rng.randrange(gamma), draft[0]] = 0.0  # q_i(x_i) = 0 somewhere: rejected there
    q = rng.choice([None, q, q, q.double(), q.bfloat16()]) if rng.random() < 0.9 else q
    return DraftRound(draft, q, random_params(rng, vocab), rng.choice([0, 5, rng.randrange(10**9)])), logits


@pytest.mark.parametrize("batch_seed", range(8))
def test_every_round_gets_the_one_round_verdict(batch_seed: int):
    rng = random.Random(batch_seed)
    generator = torch.Generator().manual_seed(batch_seed)
    vocab = rng.choice([7, 64, 300])
    pairs = [random_round(rng, generator, vocab) for _ in range(50)]
    outcomes = assert_same_outcomes([r for r, _ in pairs], [logits for _, logits in pairs])
    verdicts = [o for o in outcomes if isinstance(o, Verdict)]
    assert len(verdicts) == len(pairs)
    assert any(v.num_accepted >= 2 for v in verdicts) and any(not v.is_bonus for v in verdicts)
    assert any(v.is_bonus and v.num_accepted > 0 for v in verdicts)


def test_all_greedy_and_all_gamma_zero_steps():
    generator = torch.Generator().manual_seed(1)
    logits = [torch.randn(g + 1, 16, generator=generator) for g in (0, 0, 3)]
    greedy = [DraftRound(r[:-1].argmax(dim=-1).tolist(), None, SamplingParams(), 9) for r in logits]
    assert_same_outcomes(greedy, logits)
    sampled = SamplingParams(temperature=1.0, seed=3)
    assert_same_outcomes([DraftRound([], None, sampled, s) for s in range(4)], [logits[0]] * 4)


def test_bad_logits_fail_their_round_alone():
    generator = torch.Generator().manual_seed(2)
    vocab, params = 10, SamplingParams(temperature=1.0, seed=5)
    logits = [torch.randn(3, vocab, generator=generator) for _ in range(5)]
    logits[1][2, 4] = math.nan
    logits[2][0] = -math.inf  # a row that allows no token...
    logits[3][0] = -math.inf
    logits[3][1, 7] = math.inf  # ...named after NaN or +inf in another row of its round
    rounds = [DraftRound([1, 2], None, params, 0) for _ in logits]
    outcomes = assert_same_outcomes(rounds, logits)
    kinds = [type(o) for o in outcomes]
    assert kinds == [Verdict, NonFiniteLogitsError, NonFiniteLogitsError, NonFiniteLogitsError, Verdict]
    assert str(outcomes[3]) == "logits contain NaN or +inf" and "all -inf" in str(outcomes[2])


@pytest.mark.parametrize(
    "draft, q_shape, start",
    [([1, 10], None, 0), ([1, -1], None, 0), ([1, 2], (3, 10), 0), ([1, 2], (2, 9), 0), ([1, 2], None, -1)],
)
def test_a_round_failing_its_checks_fails_alone(draft, q_shape, start):
    generator = torch.Generator().manual_seed(3)
    params = SamplingParams(temperature=1.0, seed=8)
    q = None if q_shape is None else torch.full(q_shape, 0.1)
    rounds = [
        DraftRound([3, 4], None, params, 0),
        DraftRound(draft, q, params, start),
        DraftRound([5], None, params, 1),
    ]
    logits = [torch.randn(3, 10, generator=generator), torch.randn(3, 10, generator=generator)]
    logits.append(torch.randn(2, 10, generator=generator))
    outcomes = assert_same_outcomes(rounds, logits)
    assert isinstance(outcomes[1], ValueError) and not isinstance(outcomes[1], NonFiniteLogitsError)
    assert isinstance(outcomes[0], Verdict) and isinstance(outcomes[2], Verdict)


def test_first_committed_token_under_rejection_with_q_matches_p():
    """Drafts drawn from a real q; over many seeds the first committed token is distributed as p."""
    vocab, gamma, trials = 8, 2, 20_000
    logits = torch.tensor([[0.3, -math.inf, 1.2, 0.0, 0.8, -math.inf, 0.5, -0.4]] * (gamma + 1))  # [γ+1, V]
    params = [SamplingParams(temperature=1.0, seed=seed) for seed in range(trials)]
    p = logits_to_probs(logits, params[0])[0]  # [V]
    q = torch.tensor([[0.05, 0.2, 0.05, 0.3, 0.1, 0.1, 0.1, 0.1]] * gamma)  # [γ, V]: unlike p
    drafts = torch.multinomial(q, trials, replacement=True, generator=torch.Generator().manual_seed(4)).T.tolist()
    rounds = [DraftRound(draft, q, params[t], 7 * t) for t, draft in enumerate(drafts)]
    with torch.inference_mode():
        outcomes = judge_rounds(rounds, [logits] * trials)
    counts = torch.bincount(torch.tensor([o.tokens[0] for o in outcomes]), minlength=vocab).double()
    support = p > 0
    assert counts[~support].sum() == 0
    expected = p[support].double() / p[support].double().sum() * trials
    assert chisquare(counts[support].numpy(), expected.numpy()).pvalue > MIN_P_VALUE


@pytest.fixture(scope="module")
def packed_target(tiny_pair_dirs):
    target = LoadedModel.load(ModelSettings(str(tiny_pair_dirs[0])))
    assert target.packed
    return target


@pytest.mark.parametrize("num_sessions", [1, 3, 8])
def test_a_verify_step_reads_the_device_once(packed_target, num_sessions: int):
    """Greedy, rejection-with-q and coupled rounds in one step: the pass and the judging read back once in all."""
    rng = random.Random(num_sessions)
    vocab = packed_target.vocab_size
    sessions = [KVSession(packed_target, [rng.randrange(1, vocab) for _ in range(5 + i)]) for i in range(num_sessions)]
    run_forwards([s.plan_prefill() for s in sessions])
    settings = [
        SamplingParams(),
        SamplingParams(temperature=0.8, top_k=20, seed=1),
        SamplingParams(temperature=1.0, top_p=0.9, seed=2, rule=SamplingRule.COUPLED),
    ]
    jobs = []
    for i, session in enumerate(sessions):
        gamma, params = rng.randint(1, 4), settings[(i + 1) % 3]  # a single session: rejection with q
        q = torch.rand(gamma, vocab).softmax(dim=-1) if params is settings[1] else None
        jobs.append(VerifyJob(session, f"s{i}", len(session), [rng.randrange(vocab) for _ in range(gamma)], q, params))
    with HostSyncCounter() as syncs:
        outcomes = verify_rounds(jobs)
    assert syncs.count == 1, syncs.reads
    for job, outcome in zip(jobs, outcomes):
        verdict, timing = outcome
        assert len(job.session) == job.base_len + len(verdict.tokens)
        assert timing.sampling_ns == outcomes[0][1].sampling_ns
