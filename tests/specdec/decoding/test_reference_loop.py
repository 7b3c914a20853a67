"""The in-process loop: greedy output is token-identical to the target alone; sampling follows the target."""

from __future__ import annotations

import collections
import random

import pytest
import torch
from scipy.stats import chisquare
from tiny_models import make_pair

from specdec.decoding.reference_loop import speculative_generate, target_only_generate
from specdec.engine.model_runtime import LoadedModel, ModelSettings
from specdec.sampling.rules import SamplingParams, SamplingRule

GREEDY = SamplingParams(temperature=0.0)


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 64) for _ in range(rng.randint(1, 12))] for _ in range(count)]


@pytest.mark.parametrize("gamma", [1, 2, 4, 8])
def test_greedy_is_token_identical_to_target_only(tiny_pair, gamma):
    target, draft = tiny_pair
    saw_eos_in_block = saw_rejection = saw_bonus = False
    for prompt in prompts(20):
        expected = target_only_generate(target, prompt, GREEDY, max_new_tokens=24)
        got = speculative_generate(target, draft, prompt, gamma, GREEDY, max_new_tokens=24)
        assert got.token_ids == expected.token_ids, f"prompt {prompt}"
        assert got.finished_by_eos == expected.finished_by_eos
        stats = got.stats
        saw_rejection |= stats.accepted < stats.drafted
        saw_bonus |= len(stats.accepted_per_position) == gamma and stats.accepted_per_position[-1] > 0
        saw_eos_in_block |= got.finished_by_eos and len(got.token_ids) < 24
    assert saw_rejection and saw_eos_in_block
    assert saw_bonus or gamma == 8  # all 8 of a noisy draft's tokens accepted is rare; see the test below


def test_a_draft_equal_to_the_target_is_always_accepted(tiny_pair):
    target, _ = tiny_pair
    for prompt in prompts(5, seed=2):
        expected = target_only_generate(target, prompt, GREEDY, max_new_tokens=30)
        got = speculative_generate(target, target, prompt, 8, GREEDY, max_new_tokens=30)
        assert got.token_ids == expected.token_ids
        assert got.stats.accepted == got.stats.drafted > 0


def test_gamma_larger_than_tokens_left(tiny_pair):
    target, draft = tiny_pair
    for prompt in prompts(5, seed=1):
        for max_new in (1, 2, 3):
            expected = target_only_generate(target, prompt, GREEDY, max_new_tokens=max_new)
            got = speculative_generate(target, draft, prompt, 8, GREEDY, max_new_tokens=max_new)
            assert got.token_ids == expected.token_ids
            assert len(got.token_ids) <= max_new


def test_acceptance_stats_count_positions(tiny_pair):
    target, draft = tiny_pair
    result = speculative_generate(target, draft, [5, 6, 7], 4, GREEDY, max_new_tokens=40)
    stats = result.stats
    assert sum(stats.accepted_per_position) == stats.accepted
    assert sum(stats.drafted_per_position) == stats.drafted
    assert all(a <= d for a, d in zip(stats.accepted_per_position, stats.drafted_per_position))


def test_seeded_sampling_is_reproducible(tiny_pair):
    target, draft = tiny_pair
    params = SamplingParams(temperature=1.0, seed=7)
    first = speculative_generate(target, draft, [3, 4], 4, params, max_new_tokens=20).token_ids
    assert speculative_generate(target, draft, [3, 4], 4, params, max_new_tokens=20).token_ids == first


@pytest.mark.parametrize("gamma", [1, 3, 8])
def test_coupled_sampling_is_token_identical_to_coupled_target_only(tiny_pair, gamma):
    """Under the coupled rule a seeded request's tokens are plain decoding's, whatever γ: each committed token
    is the target's argmax(log p + g) of its position, and the draft only decides how many come per round."""
    target, draft = tiny_pair
    saw_rejection = saw_acceptance = False
    for seed, prompt in enumerate(prompts(8, seed=3)):
        params = SamplingParams(temperature=0.8, top_p=0.95, seed=seed, rule=SamplingRule.COUPLED)
        expected = target_only_generate(target, prompt, params, max_new_tokens=24)
        got = speculative_generate(target, draft, prompt, gamma, params, max_new_tokens=24)
        assert got.token_ids == expected.token_ids, f"seed {seed}, prompt {prompt}"
        saw_rejection |= got.stats.accepted < got.stats.drafted
        saw_acceptance |= got.stats.accepted > 0
    assert saw_rejection and saw_acceptance
    params = SamplingParams(temperature=1.0, seed=1, rule=SamplingRule.COUPLED)
    same = speculative_generate(target, target, [3, 4, 5], 4, params, max_new_tokens=30)
    assert same.stats.accepted == same.stats.drafted > 0  # a draft equal to the target is always accepted


@pytest.fixture(scope="module")
def vocab8_pair(tmp_path_factory):
    target_dir, draft_dir = make_pair(tmp_path_factory.mktemp("v8"), vocab_size=8, hidden=16, noise=1.0)
    settings = dict(threads=1)
    return LoadedModel.load(ModelSettings(str(target_dir), **settings)), LoadedModel.load(
        ModelSettings(str(draft_dir), **settings)
    )


def test_first_two_tokens_follow_the_target_distribution(vocab8_pair):
    """≥ 20k seeded samples of the full loop vs the target's exact two-token joint distribution."""
    target, draft = vocab8_pair
    prompt = [3, 5]
    params = dict(temperature=1.0)
    with torch.inference_mode():
        from specdec.engine.kv.session import KVSession

        first = torch.softmax(KVSession(target, prompt).extend()[-1], -1)  # [V]
        joint = torch.stack(
            [first[a] * torch.softmax(KVSession(target, prompt + [a]).extend()[-1], -1) for a in range(8)]
        )  # [V, V]
    samples = 20_000
    counts = collections.Counter()
    for seed in range(samples):
        tokens = speculative_generate(target, draft, prompt, 3, SamplingParams(seed=seed, **params), 2).token_ids
        counts[tokens[0] * 8 + tokens[1] if tokens[0] != 0 else 0] += 1  # EOS (id 0) first ends the sequence
    exact = joint.flatten().double()
    exact[:8] = 0
    exact[0] = first[0]  # cell 0 stands for "EOS first"
    expected = exact * samples
    keep = expected > 5  # chi-square needs populated cells; pool the rest
    observed = torch.tensor([counts[i] for i in range(64)], dtype=torch.float64)
    f_obs = torch.cat([observed[keep], observed[~keep].sum(0, keepdim=True)])
    f_exp = torch.cat([expected[keep], expected[~keep].sum(0, keepdim=True)])
    assert chisquare(f_obs.numpy(), f_exp.numpy() * f_obs.sum().item() / f_exp.sum().item()).pvalue > 0.001
