"""N-gram prompt lookup through the three real servers: greedy identity and the target's sampling distribution.

The draft service holds a draft model and serves both methods; every request here picks the n-gram drafter
(draft_method NGRAM). The target has a vocabulary of 8 and a fairly flat distribution, so a few thousand
seeded requests pin down the distribution of their first generated tokens.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from scipy.stats import chisquare
from tiny_models import noisy_copy, save, tiny_llama, word_tokenizer

from specdec.client import Client
from specdec.decoding.reference_loop import target_only_generate
from specdec.engine.model_runtime import LoadedModel, ModelSettings
from specdec.local_stack import LocalStack
from specdec.sampling.rules import SamplingParams, logits_to_probs
from specdec.v1 import common_pb2

VOCAB = 8
NGRAM = common_pb2.DRAFT_METHOD_NGRAM
SAMPLED_PROMPT = [1, 2, 3, 1, 2]  # the suffix [1, 2] matched at the start: the drafter proposes 3, 1, 2
SEEDS = 2000


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vocab8_pair")
    tokenizer = word_tokenizer(VOCAB)
    target = tiny_llama(VOCAB, hidden=16, layers=1, seed=3, eos_boost=0.0, init_range=0.1)
    return save(target, tokenizer, root / "target"), save(noisy_copy(target, 0.3, seed=4), tokenizer, root / "draft")


@pytest.fixture(scope="module")
def target(pair_dirs):
    return LoadedModel.load(ModelSettings(str(pair_dirs[0])))


@pytest.fixture(scope="module")
def client(pair_dirs):
    target_dir, draft_dir = pair_dirs
    # Fixed γ: the distribution test needs every request to draft exactly one token.
    with (
        LocalStack(str(target_dir), str(draft_dir), coordinator_args=["--no-adaptive-gamma"]) as stack,
        Client(stack.address, timeout_s=120) as running,
    ):
        yield running


def test_greedy_ngram_output_is_token_identical_to_target_only(client, target):
    rng = random.Random(0)
    drafted = accepted = 0
    for _ in range(6):
        motif = [rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 4))]
        prompt = (motif * 3)[: rng.randint(5, 10)]
        for gamma in (2, 5):
            reply = client.generate(
                prompt, max_new_tokens=30, num_speculative_tokens=gamma, draft_method=NGRAM, include_stats=True
            )
            assert list(reply.token_ids) == target_only_generate(target, prompt, SamplingParams(), 30).token_ids
            drafted += reply.stats.drafted_tokens
            accepted += reply.stats.accepted_tokens
    assert accepted > 0 and drafted > accepted  # the lookup proposed, some proposals held and some did not


@torch.inference_mode()
def next_token_probs(target: LoadedModel, prefix: list[int]) -> torch.Tensor:
    logits = target.model(input_ids=torch.tensor([prefix])).logits[0, -1]  # [V]
    return logits_to_probs(logits, SamplingParams(temperature=1.0))  # [V]


def test_sampled_ngram_output_follows_the_target_distribution(client, target):
    """First token: the drafted 3 is accepted with p(3) (q is one-hot), else a token comes from norm(p - q).
    Second token: the bonus after an acceptance, or a plain step after a rejection. Both must follow p."""
    first = next_token_probs(target, SAMPLED_PROMPT).double()  # [V]
    assert 0.05 < first[3] < 0.95  # both branches (accept and recover) are well exercised
    # The second token exists when the first was not EOS (id 0): its marginal given that.
    second = sum(first[t] * next_token_probs(target, SAMPLED_PROMPT + [t]).double() for t in range(1, VOCAB))  # [V]

    def one(seed: int):
        reply = client.generate(
            SAMPLED_PROMPT,
            max_new_tokens=2,
            temperature=1.0,
            seed=seed,
            num_speculative_tokens=3,
            draft_method=NGRAM,
            include_stats=True,
        )
        return list(reply.token_ids), reply.stats.drafted_tokens, reply.stats.accepted_tokens

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(SEEDS)))
    assert all(drafted == 1 for _, drafted, _ in results)  # every request went through the rejection sampler
    accept_rate = sum(accepted for _, _, accepted in results) / SEEDS
    p3 = float(first[3])
    assert abs(accept_rate - p3) < 4 * (p3 * (1 - p3) / SEEDS) ** 0.5
    for position, expected in ((0, first), (1, second)):
        tokens = [ids[position] for ids, _, _ in results if len(ids) > position]
        counts = torch.bincount(torch.tensor(tokens), minlength=VOCAB).double()
        expected_counts = expected / expected.sum() * len(tokens)
        result = chisquare(counts.numpy(), expected_counts.numpy())
        assert result.pvalue > 1e-3, f"token {position + 1}: counts {counts.tolist()} vs {expected_counts.tolist()}"
