"""Sampled output follows the target's distribution exactly.

Held to: 2,048 requests with distinct seeds, temperature 1.0, γ 4 (adaptive γ off, so each round drafts and
verifies 4 tokens), 2 new tokens, 16 at a time, pass Pearson's chi-square test at significance 0.001 against
the target's exact probabilities computed with transformers on the same prompt: on the first token, and on
the pairs (first, second token) over the target's most likely first tokens, where the second token's probabilities
are the target's after the first. Cells expected fewer than 5 times are pooled.
"""

from __future__ import annotations

import collections
import concurrent.futures

import numpy as np
import pytest
from chi_square import pooled_chisquare
from harness import request
from reference import next_token_probabilities

PROMPT = [88, 280, 221]  # "x = " in the demo vocabulary: the target's first token is "x" about half the time
NUM_SEEDS = 2048
ALPHA = 0.001
TOP_FIRST = 4  # pairs are tested after this many of the most likely first tokens
OTHER = -1


@pytest.fixture(scope="module")
def samples(shared_stack) -> list[tuple[int, ...]]:
    """The first two tokens of each seed's completion (one token when the first was EOS)."""

    def run(seed: int) -> tuple[int, ...]:
        message = request(PROMPT, 2, temperature=1.0, seed=seed, num_speculative_tokens=4)
        return tuple(shared_stack.fixed.generate(message, timeout_s=60).token_ids)

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        return list(pool.map(run, range(NUM_SEEDS)))


@pytest.fixture(scope="module")
def first_probabilities(target) -> np.ndarray:
    return next_token_probabilities(target[0], [PROMPT])[0]


def test_all_seeds_answered(samples, target):
    eos = target[1].eos_token_id
    assert len(samples) == NUM_SEEDS
    assert all(len(s) == 2 or (len(s) == 1 and s[0] == eos) for s in samples)


def test_first_token_follows_the_target(samples, first_probabilities, target):
    observed = collections.Counter(s[0] for s in samples)
    probabilities = {token: float(p) for token, p in enumerate(first_probabilities)}
    statistic, p_value, cells = pooled_chisquare(observed, probabilities, len(samples))
    assert cells >= 10, "too few cells for a meaningful test: choose another prompt"
    assert p_value > ALPHA, f"chi-square {statistic:.1f} over {cells} cells, p = {p_value:.2g}"
    # The test can tell: the same counts are far from the target at temperature 0.7.
    colder = {token: float(p) for token, p in enumerate(next_token_probabilities(target[0], [PROMPT], 0.7)[0])}
    assert pooled_chisquare(observed, colder, len(samples))[1] < ALPHA


def test_token_pairs_follow_the_target(samples, first_probabilities, target):
    eos = target[1].eos_token_id
    top_first = [int(t) for t in np.argsort(-first_probabilities) if t != eos][:TOP_FIRST]  # the most likely
    second = next_token_probabilities(target[0], [[*PROMPT, t] for t in top_first])
    probabilities = {
        (first, token): float(first_probabilities[first] * p)
        for first, row in zip(top_first, second)
        for token, p in enumerate(row)
    }
    observed = collections.Counter(s[:2] if s[0] in top_first else OTHER for s in samples)
    statistic, p_value, cells = pooled_chisquare(observed, probabilities, len(samples))
    assert cells >= 10, "too few cells for a meaningful test: choose another prompt"
    assert p_value > ALPHA, f"chi-square {statistic:.1f} over {cells} cells, p = {p_value:.2g}"
