"""The whole stack on the twin: three real services on loopback, two draft replicas, the models on
`sim:llama8b-h100:8192`, and a second coordinator with an injected network delay.

Held to, as on the real models: greedy output through every path (γ 0, 4 and 8, with and without the delay) is the
twin target's own greedy decoding, token for token; text requests, stop strings and streaming work; seeded sampled
requests equal the in-process reference loop; sampled first tokens follow the twin target's probabilities
(chi-square, as the contract suite's distribution test).
"""

from __future__ import annotations

import collections
import concurrent.futures

import pytest
import torch
from chi_square import pooled_chisquare
from seeded_reference import assert_seeded_requests_equal_the_reference
from twin_models import TWIN, load_twin

from specdec.client import Client
from specdec.decoding.reference_loop import target_only_generate
from specdec.local_stack import twin_stack
from specdec.sampling.rules import SamplingParams
from specdec.v1 import coordinator_pb2

PROMPT_TEXT = "def fibonacci(n):\n    "
NUM_SEEDS = 1024
SIGNIFICANCE = 0.001


@pytest.fixture(scope="module")
def stack(twin_cache):
    with twin_stack(TWIN, draft_replicas=2) as running:
        running.start_coordinator("coordinator-delayed", "--replica-network-delay-ms", "0.5")
        yield running


@pytest.fixture(scope="module")
def clients(stack):
    with Client(stack.address) as plain, Client(stack.services["coordinator-delayed"].address) as delayed:
        yield {"no delay": plain, "0.5 ms delay": delayed}


@pytest.fixture(scope="module")
def models(twin_cache):
    """The twin's target and draft in this process, as the replicas build them."""
    return load_twin("target"), load_twin("draft")


def test_the_coordinator_sees_both_draft_replicas(clients):
    assert len(clients["no delay"].info().draft_replicas) == 2


@pytest.mark.parametrize("gamma", [0, 4, 8])
def test_greedy_output_is_the_twin_targets_own(clients, models, gamma):
    target = models[0]
    prompt = target.tokenizer(PROMPT_TEXT)["input_ids"]
    expected = target_only_generate(target, prompt, SamplingParams(), 40).token_ids
    for name, client in clients.items():
        reply = client.generate(PROMPT_TEXT, max_new_tokens=40, num_speculative_tokens=gamma)
        assert list(reply.token_ids) == expected, name
        assert reply.text == target.tokenizer.decode(expected)


def test_text_stop_strings_and_streaming_work(clients, models):
    client, tokenizer = clients["no delay"], models[0].tokenizer
    full = client.generate(PROMPT_TEXT, max_new_tokens=40)
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 4]
    stopped = client.generate(PROMPT_TEXT, max_new_tokens=40, stop=[stop])
    assert stopped.finish_reason == coordinator_pb2.FINISH_REASON_STOP
    assert stopped.text == full.text[: full.text.index(stop)]
    chunks = list(client.stream(PROMPT_TEXT, max_new_tokens=40))
    assert len(chunks) > 1 and "".join(chunk.text for chunk in chunks) == full.text
    assert tokenizer.decode([t for chunk in chunks for t in chunk.token_ids]) == full.text


def test_seeded_requests_equal_the_reference_loop(clients, models):
    prompts = [list(range(200 + 7 * i, 230 + 7 * i)) for i in range(3)]
    assert_seeded_requests_equal_the_reference(list(clients.values()), *models, prompts, 16)


def test_sampled_first_tokens_follow_the_twin_target(clients, models):
    target = models[0]
    prompt = target.tokenizer(PROMPT_TEXT)["input_ids"]
    client = clients["no delay"]

    def first_token(seed: int) -> int:  # two new tokens: the first is drafted and judged, not a plain step
        kwargs = dict(max_new_tokens=2, temperature=1.0, seed=seed, num_speculative_tokens=4)
        return client.generate(prompt, **kwargs).token_ids[0]

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        observed = collections.Counter(pool.map(first_token, range(NUM_SEEDS)))
    session_logits = target.forward(torch.tensor([prompt]), target.new_cache())[-1]  # [V]
    probabilities = dict(enumerate(torch.softmax(session_logits.double(), -1).tolist()))
    statistic, p_value, cells = pooled_chisquare(observed, probabilities, NUM_SEEDS)
    assert cells >= 10, "too few cells for a meaningful test"
    assert p_value > SIGNIFICANCE, f"chi-square {statistic:.1f} over {cells} cells, p = {p_value:.2g}"
    colder = dict(enumerate(torch.softmax(session_logits.double() / 0.7, -1).tolist()))
    assert pooled_chisquare(observed, colder, NUM_SEEDS)[1] < SIGNIFICANCE  # the test can tell
