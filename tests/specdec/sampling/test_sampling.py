"""Tests for specdec.sampling.rules: hand-made probability tables, then distribution checks."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare, kstest

from specdec.sampling import rules
from specdec.sampling.coupled_noise import exponential_noise
from specdec.sampling.rules import (
    NonFiniteLogitsError,
    SamplingParams,
    SamplingRule,
    Stream,
    Verdict,
    acceptance_probability,
    coupled_sample,
    coupled_scores,
    logits_to_probs,
    plain_token,
    position_generator,
    position_uniform,
    rejection_sample,
    residual_distribution,
    sample_token,
    sample_verdict,
)

GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=1.0, seed=1234)
COUPLED = SamplingParams(temperature=1.0, seed=1234, rule=SamplingRule.COUPLED)
MIN_P_VALUE = 0.001

# The worked example: vocabulary {cat, dog, mat, sat, on}.
CAT, DOG, MAT, SAT, ON = range(5)
Q_EXAMPLE = torch.tensor([0.5, 0.2, 0.2, 0.1, 0.0])
P_EXAMPLE = torch.tensor([0.4, 0.1, 0.3, 0.15, 0.05])


def _normalised(weights: list[float]) -> torch.Tensor:
    t = torch.tensor(weights, dtype=torch.float32)
    return t / t.sum()


def _one_hot_rows(argmaxes: list[int], vocab: int = 5) -> torch.Tensor:
    """Target probabilities [len, vocab] whose argmaxes are given, with some mass elsewhere."""
    rows = torch.full((len(argmaxes), vocab), 0.1)
    rows[torch.arange(len(argmaxes)), argmaxes] = 0.6
    return rows / rows.sum(dim=-1, keepdim=True)


INF_LOGIT = math.inf

# --- the worked example ---------------------------------------------------------------------------


def test_worked_example_acceptance_probabilities():
    assert acceptance_probability(P_EXAMPLE, Q_EXAMPLE, DOG) == pytest.approx(0.5)
    assert acceptance_probability(P_EXAMPLE, Q_EXAMPLE, CAT) == pytest.approx(0.8)
    assert acceptance_probability(P_EXAMPLE, Q_EXAMPLE, MAT) == 1.0
    assert acceptance_probability(P_EXAMPLE, Q_EXAMPLE, SAT) == 1.0
    assert acceptance_probability(P_EXAMPLE, Q_EXAMPLE, ON) == 0.0  # q = 0: never accepted


def test_worked_example_residual():
    residual = residual_distribution(P_EXAMPLE, Q_EXAMPLE)
    torch.testing.assert_close(residual, torch.tensor([0.0, 0.0, 0.5, 0.25, 0.25]))


def test_residual_falls_back_to_p_when_p_equals_q():
    torch.testing.assert_close(residual_distribution(P_EXAMPLE, P_EXAMPLE.clone()), P_EXAMPLE)


def test_residual_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="p and q"):
        residual_distribution(P_EXAMPLE, Q_EXAMPLE[:4])


# --- logits_to_probs ------------------------------------------------------------------------------


def test_temperature_scales_logits():
    logits = torch.tensor([0.0, math.log(4.0)])
    torch.testing.assert_close(logits_to_probs(logits, SamplingParams(temperature=1.0)), torch.tensor([0.2, 0.8]))
    torch.testing.assert_close(  # T = 2 halves the log-odds: weights 1 : 2
        logits_to_probs(logits, SamplingParams(temperature=2.0)), torch.tensor([1 / 3, 2 / 3])
    )


@pytest.mark.parametrize("temperature", [1.17549435e-38, 1e-45, 1e-30])
def test_tiny_temperature_is_near_greedy_not_an_overflow(temperature: float):
    """Found by the coordinator fuzz test: logits / 1e-38 overflowed to +inf (NaN probabilities)."""
    logits = torch.tensor([[1.0, 3.0, 2.0, -math.inf], [0.5, 0.5, -1.0, 0.0]])
    probs = logits_to_probs(logits, SamplingParams(temperature=temperature, seed=1))
    assert torch.isfinite(probs).all()
    assert probs[0].tolist() == [0.0, 1.0, 0.0, 0.0] and probs[1].tolist() == [0.5, 0.5, 0.0, 0.0]


def test_top_k_masks_and_renormalises():
    logits = torch.tensor([1.0, 3.0, 2.0, 0.0])
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    e3, e2 = math.exp(3.0), math.exp(2.0)
    torch.testing.assert_close(probs, torch.tensor([0.0, e3 / (e3 + e2), e2 / (e3 + e2), 0.0]))
    assert probs[0] == 0 and probs[3] == 0


def test_top_k_keeps_ties_and_is_off_when_at_least_vocab():
    top_1 = SamplingParams(temperature=1.0, top_k=1)
    tied = logits_to_probs(torch.tensor([1.0, 2.0, 2.0, 0.0]), top_1)
    torch.testing.assert_close(tied, torch.tensor([0.0, 0.5, 0.5, 0.0]))
    logits = torch.tensor([1.0, 2.0, 0.5])
    off = logits_to_probs(logits, SamplingParams(temperature=1.0))
    for top_k in (3, 99):
        probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=top_k))
        torch.testing.assert_close(probs, off)


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [
        (0.7, [0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]),  # 0.5 < 0.7, so 0.3 joins; then 0.8 >= 0.7
        (0.85, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),
        (0.1, [1.0, 0.0, 0.0, 0.0]),  # the most likely token always survives
        (1.0, [0.5, 0.3, 0.15, 0.05]),
    ],
)
def test_top_p_keeps_smallest_set_reaching_mass(top_p: float, expected: list[float]):
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))
    torch.testing.assert_close(probs, torch.tensor(expected))


def test_top_p_applies_after_top_k():
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    # top-k=2 leaves (4/7, 3/7); 4/7 alone reaches 0.5, so top-p keeps one token. Top-p on the
    # original distribution would have kept two (0.4 < 0.5).
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2, top_p=0.5))
    torch.testing.assert_close(probs, torch.tensor([1.0, 0.0, 0.0, 0.0]))


def test_greedy_is_one_hot_at_argmax_for_batched_logits():
    logits = torch.tensor([[[0.1, 2.0, -1.0], [5.0, 5.0, 1.0]]], dtype=torch.float16)  # [1, 2, 3]
    probs = logits_to_probs(logits, GREEDY)
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs, torch.tensor([[[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]]))


def test_minus_inf_is_a_legal_mask_and_output_is_float32():
    logits = torch.tensor([0.0, -math.inf, 0.0], dtype=torch.bfloat16)
    probs = logits_to_probs(logits, SamplingParams(temperature=0.7))
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs, torch.tensor([0.5, 0.0, 0.5]))


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize(
    "logits",
    [
        torch.tensor([0.0, math.nan, 1.0]),
        torch.tensor([0.0, math.inf, 1.0]),
        torch.tensor([[0.0, 1.0], [-math.inf, -math.inf]]),
    ],
    ids=["nan", "plus-inf", "all-minus-inf-row"],
)
def test_non_finite_logits_raise(logits: torch.Tensor, params: SamplingParams):
    with pytest.raises(NonFiniteLogitsError):
        logits_to_probs(logits, params)


def test_non_finite_logits_error_is_a_value_error():
    assert issubclass(NonFiniteLogitsError, ValueError)


def test_empty_vocab_raises():
    with pytest.raises(ValueError, match="logits"):
        logits_to_probs(torch.zeros(2, 0), SAMPLED)


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("temperature", {"temperature": -0.1}),
        ("temperature", {"temperature": math.nan}),
        ("temperature", {"temperature": math.inf}),
        ("top_k", {"top_k": -1}),
        ("top_p", {"top_p": 0.0}),
        ("top_p", {"top_p": 1.5}),
        ("top_p", {"top_p": math.nan}),
        ("seed", {"seed": -1}),
        ("seed", {"seed": 2**64}),
    ],
)
def test_validation_names_the_field(field: str, kwargs: dict):
    params = SamplingParams(**kwargs)
    with pytest.raises(ValueError, match=field):
        params.validate()
    with pytest.raises(ValueError, match=field):
        logits_to_probs(torch.zeros(3), params)


def test_greedy_property():
    assert GREEDY.greedy
    assert not SamplingParams(temperature=1e-3).greedy


# --- randomness: counter-based and deterministic --------------------------------------------------


def _no_rng(*args, **kwargs):
    raise AssertionError("greedy decoding must not draw random numbers")


@pytest.fixture
def no_rng(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rules, "position_uniform", _no_rng)
    monkeypatch.setattr(rules, "position_generator", _no_rng)


def test_position_generator_is_a_pure_function_of_its_key():
    def draws(seed: int, position: int, stream: Stream) -> list[float]:
        return torch.rand(4, generator=position_generator(seed, position, stream)).tolist()

    base = draws(7, 100, Stream.ACCEPT)
    assert draws(7, 100, Stream.ACCEPT) == base
    assert draws(7, 101, Stream.ACCEPT) != base
    assert draws(7, 100, Stream.RESAMPLE) != base
    assert draws(7, 100, Stream.DRAFT) != base
    assert draws(8, 100, Stream.ACCEPT) != base


def test_position_uniform_is_a_pure_function_of_its_key():
    base = position_uniform(7, 100, Stream.ACCEPT)
    assert position_uniform(7, 100, Stream.ACCEPT) == base
    others = [
        position_uniform(7, 101, Stream.ACCEPT),
        position_uniform(7, 100, Stream.RESAMPLE),
        position_uniform(7, 100, Stream.DRAFT),
        position_uniform(8, 100, Stream.ACCEPT),
    ]
    assert base not in others


def test_position_uniform_is_uniform_over_positions():
    draws = [position_uniform(3, position, Stream.ACCEPT) for position in range(5000)]
    assert all(0.0 <= u < 1.0 for u in draws)
    assert kstest(draws, "uniform").pvalue > MIN_P_VALUE


@pytest.mark.parametrize("draw", [position_uniform, position_generator])
def test_position_draws_reject_out_of_range_keys(draw):
    with pytest.raises(ValueError, match="position"):
        draw(0, -1, Stream.DRAFT)
    with pytest.raises(ValueError, match="seed"):
        draw(2**64, 0, Stream.DRAFT)


def test_sample_token_is_deterministic_per_position():
    probs = _normalised([1, 1, 1, 1, 1, 1, 1, 1])
    first = [sample_token(probs, SAMPLED, position) for position in range(64)]
    assert [sample_token(probs, SAMPLED, position) for position in range(64)] == first
    assert len(set(first)) > 1  # positions give different draws
    resampled = [sample_token(probs, SAMPLED, position, Stream.RESAMPLE) for position in range(64)]
    assert resampled != first


def test_sampling_leaves_global_rng_untouched():
    state = torch.get_rng_state()
    sample_token(P_EXAMPLE, SAMPLED, 3)
    rejection_sample([DOG], Q_EXAMPLE[None], torch.stack([P_EXAMPLE, P_EXAMPLE]), SAMPLED, 3)
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.usefixtures("no_rng")
def test_sample_token_greedy_is_argmax_and_uses_no_rng():
    assert sample_token(P_EXAMPLE, GREEDY, 0) == CAT


def test_sample_token_matches_probs():
    probs = _normalised([0.1, 0.0, 0.4, 0.2, 0.0, 0.3])
    num_draws = 10_000
    counts = torch.zeros(6)
    for position in range(num_draws):
        counts[sample_token(probs, SAMPLED, position)] += 1
    _assert_matches(counts, probs)


def test_sample_token_rejects_bad_probs():
    with pytest.raises(ValueError, match="probs"):
        sample_token(torch.zeros(3), SAMPLED, 0)
    with pytest.raises(ValueError, match="probs"):
        sample_token(torch.tensor([0.5, math.nan, 0.5]), SAMPLED, 0)
    with pytest.raises(ValueError, match="shape"):
        sample_token(torch.ones(2, 3), SAMPLED, 0)


def test_rejection_sample_is_deterministic():
    p = torch.stack([P_EXAMPLE, _normalised([1, 2, 3, 4, 5])])
    q = Q_EXAMPLE[None]
    verdicts = [rejection_sample([DOG], q, p, SAMPLED, position) for position in range(50)]
    assert [rejection_sample([DOG], q, p, SAMPLED, position) for position in range(50)] == verdicts
    assert len({v.tokens[0] for v in verdicts}) > 1
    reseeded = SamplingParams(temperature=1.0, seed=SAMPLED.seed + 1)
    assert [rejection_sample([DOG], q, p, reseeded, position) for position in range(50)] != verdicts


# --- rejection_sample: greedy ---------------------------------------------------------------------


@pytest.mark.usefixtures("no_rng")
def test_greedy_all_accepted_gives_bonus():
    verdict = rejection_sample([2, 0, 1], None, _one_hot_rows([2, 0, 1, 4]), GREEDY, 10)
    assert verdict == Verdict(accepted_tokens=[2, 0, 1], next_token=4, is_bonus=True)
    assert verdict.num_accepted == 3
    assert verdict.tokens == [2, 0, 1, 4]


@pytest.mark.usefixtures("no_rng")
def test_greedy_reject_at_position_2_recovers_argmax():
    q = torch.full((3, 5), 0.2)  # ignored under greedy
    verdict = rejection_sample([2, 3, 1], q, _one_hot_rows([2, 0, 1, 4]), GREEDY, 10)
    assert verdict == Verdict(accepted_tokens=[2], next_token=0, is_bonus=False)
    assert verdict.num_accepted == 1
    assert verdict.tokens == [2, 0]


@pytest.mark.usefixtures("no_rng")
def test_greedy_reject_first_token():
    verdict = rejection_sample([3, 0], None, _one_hot_rows([2, 0, 1]), GREEDY, 0)
    assert verdict.tokens == [2] and not verdict.is_bonus


@pytest.mark.usefixtures("no_rng")
def test_greedy_gamma_zero_is_a_plain_decode_step():
    verdict = rejection_sample([], None, _one_hot_rows([3]), GREEDY, 0)
    assert verdict == Verdict(accepted_tokens=[], next_token=3, is_bonus=True)


@pytest.mark.usefixtures("no_rng")
def test_greedy_with_logits_to_probs_output():
    logits = torch.tensor([[0.0, 5.0, 1.0], [2.0, 0.0, 1.0]])
    verdict = rejection_sample([1], None, logits_to_probs(logits, GREEDY), GREEDY, 0)
    assert verdict.tokens == [1, 0]


# --- rejection_sample: sampled, hand-made -------------------------------------------------------


def test_sampled_p_equal_q_accepts_everything():
    p = torch.stack([P_EXAMPLE] * 3)
    for position in range(0, 60, 3):
        verdict = rejection_sample([CAT, SAT], p[:2], p, SAMPLED, position)
        assert verdict.accepted_tokens == [CAT, SAT] and verdict.is_bonus


def test_sampled_token_the_target_rules_out_is_always_rejected():
    p = _normalised([0.0, 1.0, 1.0, 0.0, 0.0])[None].repeat(2, 1)
    q = _normalised([1, 1, 1, 1, 1])[None]
    for position in range(0, 40, 2):
        verdict = rejection_sample([CAT], q, p, SAMPLED, position)
        assert verdict.num_accepted == 0 and verdict.next_token in (DOG, MAT)


def test_sampled_token_with_zero_draft_probability_is_rejected():
    p = _normalised([1, 1, 1, 1, 1])[None].repeat(2, 1)
    for position in range(0, 40, 2):
        verdict = rejection_sample([ON], Q_EXAMPLE[None], p, SAMPLED, position)
        assert verdict.num_accepted == 0 and not verdict.is_bonus


def test_sampled_tiny_draft_probability_does_not_overflow_the_ratio():
    q = torch.tensor([[1e-40, 1.0]])  # a float32 subnormal: p/q would overflow in float32
    p = torch.tensor([[0.5, 0.5], [0.5, 0.5]])
    for position in range(0, 20, 2):
        assert rejection_sample([0], q, p, SAMPLED, position).accepted_tokens == [0]


def test_sampled_gamma_zero_draws_from_p():
    p = _normalised([1, 2, 3, 4, 5])[None]
    for position in range(20):
        verdict = rejection_sample([], None, p, SAMPLED, position)
        assert verdict.is_bonus and verdict.accepted_tokens == []
        assert verdict.next_token == sample_token(p[0], SAMPLED, position, Stream.RESAMPLE)


@pytest.mark.parametrize(
    ("draft", "q_shape", "p_shape", "start", "match"),
    [
        ([1, 2], (2, 5), (2, 5), 0, "p must have shape"),
        ([1, 2], (2, 5), (3,), 0, "p must have shape"),
        ([1, 2], (2, 4), (3, 5), 0, "q must have shape"),
        ([1, 2], (1, 5), (3, 5), 0, "q must have shape"),
        ([1, 5], (2, 5), (3, 5), 0, "draft_tokens"),
        ([1, -1], None, (3, 5), 0, "draft_tokens"),
        ([1, 2], (2, 5), (3, 5), -1, "start_position"),
    ],
)
def test_rejection_sample_validates_inputs(draft, q_shape, p_shape, start, match):
    q = None if q_shape is None else torch.full(q_shape, 0.2)
    with pytest.raises(ValueError, match=match):
        rejection_sample(draft, q, torch.full(p_shape, 0.2), SAMPLED, start)


@settings(max_examples=40, deadline=None, database=None)
@given(
    gamma=st.integers(0, 4),
    one_hot_draft=st.booleans(),
    seed=st.integers(0, 2**64 - 1),
    start=st.integers(0, 10**6),
    data=st.data(),
)
def test_verdict_invariants(gamma: int, one_hot_draft: bool, seed: int, start: int, data):
    vocab = 6
    generator = torch.Generator().manual_seed(seed % 2**32)
    p = torch.rand(gamma + 1, vocab, generator=generator)
    p[torch.rand(gamma + 1, vocab, generator=generator) < 0.3] = 0.0  # some ruled-out tokens
    p[:, 0] += 0.01  # every row keeps some mass
    p = p / p.sum(dim=-1, keepdim=True)
    q = torch.randn(gamma, vocab, generator=generator).softmax(dim=-1)
    q = None if one_hot_draft else q
    draft = data.draw(st.lists(st.integers(0, vocab - 1), min_size=gamma, max_size=gamma))
    verdict = rejection_sample(draft, q, p, SamplingParams(temperature=1.0, seed=seed), start)
    n = verdict.num_accepted
    assert verdict.accepted_tokens == draft[:n]
    assert verdict.is_bonus == (n == gamma)
    assert all(p[i, draft[i]] > 0 for i in range(n))  # the target never rules out an accepted token
    assert p[n, verdict.next_token] > 0  # nor the recovered or bonus token


# --- rejection_sample: the output distribution is p -----------------------------------------------


def _distribution_pair(vocab: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Random p, q [V] with zeros: p rules out tokens 1, 5, 7; q rules out 2, 6, 7."""
    generator = torch.Generator().manual_seed(2024)
    p = torch.rand(vocab, generator=generator) + 0.05
    q = torch.rand(vocab, generator=generator) + 0.05
    p[[1, 5, 7]] = 0.0
    q[[2, 6, 7]] = 0.0
    return p / p.sum(), q / q.sum()


def _assert_matches(counts: torch.Tensor, probs: torch.Tensor) -> None:
    """Tokens with zero probability never occur; the rest pass a chi-square test against probs."""
    support = probs > 0
    assert counts[~support].sum() == 0, f"zero-probability tokens drawn: {counts.tolist()}"
    expected = probs[support].double() / probs[support].double().sum() * counts.sum().item()
    result = chisquare(counts[support].double().numpy(), expected.numpy())
    assert result.pvalue > MIN_P_VALUE, f"counts {counts.tolist()} vs p {probs.tolist()}: {result}"


def _first_token_counts(draft_rows: list[list[int]], q: torch.Tensor | None, p: torch.Tensor) -> torch.Tensor:
    """Run one round per draft (each on its own positions) and count the first emitted tokens."""
    gamma = p.shape[0] - 1
    counts = [0] * p.shape[1]
    with torch.inference_mode():  # as in the services; trims per-call overhead
        for trial, draft in enumerate(draft_rows):
            counts[rejection_sample(draft, q, p, SAMPLED, trial * (gamma + 1)).tokens[0]] += 1
    return torch.tensor(counts, dtype=torch.float64)


def _drafts_from(q: torch.Tensor, num_trials: int) -> list[list[int]]:
    """num_trials drafts [γ], position i drawn from q[i] (the draft's own randomness)."""
    generator = torch.Generator().manual_seed(99)
    return torch.multinomial(q, num_trials, replacement=True, generator=generator).T.tolist()


def test_one_step_output_matches_p():
    p, q = _distribution_pair()
    bonus = _normalised([1] * 8)  # distinct from p: the bonus must not leak into the first token
    counts = _first_token_counts(_drafts_from(q[None], 200_000), q[None], torch.stack([p, bonus]))
    _assert_matches(counts, p)


def test_one_hot_draft_output_matches_p():
    p, _ = _distribution_pair()
    drafts = [[trial % 8] for trial in range(15_000)]  # any fixed proposal, even ruled-out ones
    counts = _first_token_counts(drafts, None, torch.stack([p, _normalised([1] * 8)]))
    _assert_matches(counts, p)


def test_gamma_3_first_token_matches_p():
    p, q = _distribution_pair()
    p_later, q_later = _distribution_pair()[::-1]
    q_rows = torch.stack([q, q_later, q])  # [3, V]
    p_rows = torch.stack([p, p_later, q, p_later])  # [4, V]
    counts = _first_token_counts(_drafts_from(q_rows, 15_000), q_rows, p_rows)
    _assert_matches(counts, p)


# --- the coupled rule (Gumbel-max coupling) --------------------------------------------------------


@pytest.mark.usefixtures("no_rng")
def test_coupled_greedy_is_argmax_and_uses_no_rng():
    greedy = SamplingParams(rule=SamplingRule.COUPLED)
    assert not greedy.coupled
    assert plain_token(P_EXAMPLE, greedy, 0) == CAT
    p = _one_hot_rows([2, 0])
    assert sample_verdict([2], None, p, greedy, 0) == Verdict([2], 0, is_bonus=True)


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=1.0),
        dict(temperature=0.8, top_k=4),
        dict(temperature=0.8, top_p=0.7),
        dict(temperature=1.3, top_k=5, top_p=0.9),
    ],
)
def test_coupled_draw_matches_p_with_masks(params: dict):
    """The coupled token over many seeds (one position) and over many positions (one seed) is distributed as p,
    masks included: tokens top-k or top-p removed are never drawn."""
    logits = torch.tensor([1.2, -0.3, 0.8, 2.0, -1.5, 0.1, 0.5, -INF_LOGIT])
    probs = logits_to_probs(logits, SamplingParams(**params))
    assert (probs == 0).sum() >= 1
    draws = 6000
    over_seeds = torch.zeros(8)
    over_positions = torch.zeros(8)
    for trial in range(draws):
        over_seeds[plain_token(probs, SamplingParams(**params, seed=trial, rule=SamplingRule.COUPLED), 17)] += 1
        over_positions[plain_token(probs, SamplingParams(**params, seed=3, rule=SamplingRule.COUPLED), trial)] += 1
    _assert_matches(over_seeds, probs)
    _assert_matches(over_positions, probs)


@settings(max_examples=60, deadline=None, database=None)
@given(
    gamma=st.integers(0, 6),
    seed=st.integers(0, 2**64 - 1),
    start=st.integers(0, 10**6),
    with_q=st.booleans(),
    data=st.data(),
)
def test_coupled_verdict_emits_exactly_the_plain_coupled_tokens(gamma, seed, start, with_q, data):
    """Whatever the draft (and whatever q, which the rule ignores): the committed tokens are the plain coupled
    tokens of their positions, and a draft of exactly those tokens is accepted whole."""
    vocab = 6
    generator = torch.Generator().manual_seed(seed % 2**32)
    p = torch.rand(gamma + 1, vocab, generator=generator)
    p[torch.rand(gamma + 1, vocab, generator=generator) < 0.3] = 0.0
    p[:, 0] += 0.01
    p = p / p.sum(dim=-1, keepdim=True)
    q = torch.randn(gamma, vocab, generator=generator).softmax(dim=-1) if with_q else None
    params = SamplingParams(temperature=1.0, seed=seed, rule=SamplingRule.COUPLED)
    plain = [plain_token(p[i], params, start + i) for i in range(gamma + 1)]
    draft = data.draw(st.lists(st.integers(0, vocab - 1), min_size=gamma, max_size=gamma))
    verdict = sample_verdict(draft, q, p, params, start)
    n = verdict.num_accepted
    assert verdict.accepted_tokens == draft[:n] == plain[:n]
    assert verdict.next_token == plain[n] and verdict.is_bonus == (n == gamma)
    assert n == gamma or draft[n] != plain[n]
    assert coupled_sample(plain[:gamma], p, params, start) == Verdict(plain[:gamma], plain[gamma], is_bonus=True)


def test_a_coupled_draft_agrees_with_the_target_far_more_often_than_an_independent_draw():
    """The draft's argmax(log q + g) and the target's argmax(log p + g) share g: they agree far more often than
    independent draws from q and p would (which is what lets coupled drafts be accepted)."""
    p, q = _distribution_pair()
    agree = sum(plain_token(p, COUPLED, t) == plain_token(q, COUPLED, t) for t in range(3000))
    assert agree / 3000 > float((p * q).sum()) + 0.1


def test_coupled_scores_divide_each_row_by_the_noise_of_its_own_draw():
    p, q = _distribution_pair()
    rows = coupled_scores(torch.stack([p, q]), [(COUPLED.seed, 40), (COUPLED.seed, 41)])  # [2, V]
    assert torch.equal(rows[1], coupled_scores(q[None], [(COUPLED.seed, 41)])[0])
    key = rules._position_key(COUPLED.seed, 40, Stream.GUMBEL)
    assert torch.equal(rows[0], p / exponential_noise([key], 8, torch.device("cpu"))[0])
    assert (rows[0][p == 0] == 0).all() and (rows[0][p > 0] > 0).all()
    with pytest.raises(ValueError, match="a row per draw"):
        coupled_scores(torch.stack([p, q]), [(COUPLED.seed, 40)])


def test_sampling_rule_is_validated():
    with pytest.raises(ValueError, match="rule"):
        SamplingParams(temperature=1.0, rule="coupled").validate()
