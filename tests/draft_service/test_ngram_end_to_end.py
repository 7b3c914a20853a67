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
SAMPLED_PROMPT = [1, 2, 3, 1]  # a first token 2 (from the prefill) makes the suffix [1, 2]: the drafter proposes 3
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
    """First token: drawn from the verifier's prefill, it must follow p. Where it is 2, the suffix [1, 2] matches at
    the prompt's start and the drafter proposes 3: the second token is then the drafted 3, accepted with p(3) (q is
    one-hot), or one drawn from norm(p - q); it too must follow p."""
    first = next_token_probs(target, SAMPLED_PROMPT).double()  # [V]
    after_two = next_token_probs(target, SAMPLED_PROMPT + [2]).double()  # [V]
    assert first[2] > 0.05 and 0.05 < after_two[3] < 0.95  # both branches (accept and recover) are well exercised

    def one(seed: int):
        reply = client.generate(
            SAMPLED_PROMPT,
            max_new_tokens=3,  # after the first token: a round of 2 tokens drafts 1 (a block leaves room for its bonus)
            temperature=1.0,
            seed=seed,
            num_speculative_tokens=3,
            draft_method=NGRAM,
            include_stats=True,
        )
        return list(reply.token_ids), reply.stats.drafted_tokens, reply.stats.accepted_tokens

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(SEEDS)))
    drafted_on = [(ids, drafted, accepted) for ids, drafted, accepted in results if ids[0] == 2]
    assert all(drafted == 1 for _, drafted, _ in drafted_on)  # each went through the sampler with the draft 3
    accept_rate = sum(accepted for _, _, accepted in drafted_on) / len(drafted_on)
    p3 = float(after_two[3])
    assert abs(accept_rate - p3) < 4 * (p3 * (1 - p3) / len(drafted_on)) ** 0.5
    for tokens, expected in (
        ([ids[0] for ids, _, _ in results], first),
        ([ids[1] for ids, _, _ in drafted_on], after_two),
    ):
        counts = torch.bincount(torch.tensor(tokens), minlength=VOCAB).double()
        expected_counts = expected / expected.sum() * len(tokens)
        result = chisquare(counts.numpy(), expected_counts.numpy())
        assert result.pvalue > 1e-3, f"counts {counts.tolist()} vs {expected_counts.tolist()}"
