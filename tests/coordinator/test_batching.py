"""Continuous batching through the real servers: concurrent sessions of different lengths share passes and
each still gets exactly its own result, with adaptive γ on (greedy) and under sampling."""

from __future__ import annotations

import asyncio
import random
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from scipy.stats import chisquare

from specdec.client import Client
from specdec.decoding.reference_loop import target_only_generate
from specdec.decoding.verification import verify_round
from specdec.engine.kv.session import KVSession
from specdec.local_stack import LocalStack
from specdec.sampling.rules import SamplingParams, logits_to_probs
from specdec.v1 import common_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc

PROMPT_LENGTHS = (2, 5, 9, 14, 20, 27, 35, 44)
MAX_NEW = 24
SEEDS = 1200


@pytest.fixture(scope="module")
def stack(tiny_pair_dirs):
    """Batching and adaptive γ as deployed (their defaults)."""
    target_dir, draft_dir = tiny_pair_dirs
    with LocalStack(str(target_dir), str(draft_dir)) as running:
        yield running


@pytest.fixture(scope="module")
def client(stack):
    with Client(stack.address, timeout_s=120) as c:
        yield c


@pytest.fixture(scope="module")
def fixed_gamma_client(stack):
    """A second coordinator on the same batching replicas that always drafts the request's γ. (On the tiny pair
    a draft pass costs about a target pass, so adaptive γ rightly chooses plain decoding.)"""
    service = stack.start_coordinator("coordinator-fixed-gamma", "--no-adaptive-gamma")
    with Client(service.address, timeout_s=120) as c:
        yield c
    service.stop()


def prompts_of_different_lengths(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 64) for _ in range(length)] for length in PROMPT_LENGTHS]


@pytest.mark.parametrize("coordinator", ["client", "fixed_gamma_client"])
def test_eight_concurrent_prompts_of_different_lengths_are_token_identical(coordinator, request, tiny_pair):
    client = request.getfixturevalue(coordinator)
    target, _ = tiny_pair
    prompts = prompts_of_different_lengths(seed=21)
    gammas = [4, 0, 4, 2, 4, 0, 3, 4]  # plain rows and speculative rows share the verifier's passes
    with ThreadPoolExecutor(len(prompts)) as pool:
        replies = list(
            pool.map(
                lambda pg: client.generate(
                    pg[0], max_new_tokens=MAX_NEW, num_speculative_tokens=pg[1], include_stats=True
                ),
                zip(prompts, gammas),
            )
        )
    for prompt, reply in zip(prompts, replies):
        assert list(reply.token_ids) == target_only_generate(target, prompt, SamplingParams(), MAX_NEW).token_ids
    if coordinator == "fixed_gamma_client":
        # a request whose first token (from the verifier's prefill) ends it drafts nothing
        assert all(r.stats.drafted_tokens > 0 for r, gamma in zip(replies, gammas) if gamma and len(r.token_ids) > 1)


async def concurrent_verify_rounds(address: str, prompts: list[list[int]], drafts: list[list[int]], rounds: int):
    """Opens one verify session per prompt, then runs `rounds` rounds of one Verify per session sent together."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        ids = [f"batch-{i}" for i in range(len(prompts))]
        await asyncio.gather(
            *(
                stub.OpenSession(
                    verifier_pb2.OpenVerifySessionRequest(
                        session_id=i, prompt_token_ids=p, sampling=common_pb2.SamplingParams()
                    )
                )
                for i, p in zip(ids, prompts)
            )
        )
        lengths = [len(p) for p in prompts]
        history = []
        try:
            for _ in range(rounds):
                replies = await asyncio.gather(
                    *(
                        stub.Verify(verifier_pb2.VerifyRequest(session_id=i, base_len=n, draft_token_ids=d))
                        for i, n, d in zip(ids, lengths, drafts)
                    )
                )
                history.append(replies)
                lengths = [reply.session_len for reply in replies]
        finally:
            await asyncio.gather(*(stub.CloseSession(common_pb2.CloseSessionRequest(session_id=i)) for i in ids))
    return history


def test_concurrent_verify_calls_share_passes_and_each_gets_its_own_verdict(stack, tiny_pair):
    target, _ = tiny_pair
    prompts = prompts_of_different_lengths(seed=22)
    rng = random.Random(4)
    drafts = [[rng.randrange(1, 64) for _ in range(size)] for size in (0, 1, 2, 3, 4, 5, 6, 7)]
    history = asyncio.run(concurrent_verify_rounds(stack.services["verify"].address, prompts, drafts, rounds=6))
    assert max(reply.batch_rows for replies in history for reply in replies) > 1, "no pass was shared"
    references = [KVSession(target, p) for p in prompts]
    for reference in references:
        reference.prefill()
    for round_index, replies in enumerate(history):  # the same rounds one session at a time, in process
        for index, (reference, draft, reply) in enumerate(zip(references, drafts, replies)):
            verdict, _ = verify_round(reference, str(index), len(reference), draft, None, SamplingParams())
            assert (list(reply.accepted_token_ids), reply.next_token_id) == (
                verdict.accepted_tokens,
                verdict.next_token,
            )
            assert reply.session_len == len(reference)
            assert reply.batch_tokens >= len(draft) + (round_index > 0)  # a first round starts from the kept row


@torch.inference_mode()
def next_token_probs(target, prefix: list[int]) -> torch.Tensor:
    logits = target.model(input_ids=torch.tensor([prefix])).logits[0, -1]  # [V]
    return logits_to_probs(logits, SamplingParams(temperature=1.0)).double()  # [V]


def test_sampled_output_follows_the_target_distribution_under_batching(fixed_gamma_client, tiny_pair):
    """Concurrent sampled requests, whose rounds share batched draft and verify passes, still draw the first
    two tokens from the target's own distribution."""
    target, _ = tiny_pair
    prompt = [5, 17, 33]
    first = next_token_probs(target, prompt)  # [V]
    second = sum(first[t] * next_token_probs(target, prompt + [t]) for t in range(1, target.vocab_size))  # [V]

    def one(seed: int) -> tuple[list[int], int]:
        reply = fixed_gamma_client.generate(
            prompt, max_new_tokens=3, temperature=1.0, seed=seed, num_speculative_tokens=3, include_stats=True
        )
        return list(reply.token_ids), reply.stats.drafted_tokens

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(SEEDS)))
    # the first token comes from the prefill; the round after it drafts 1 token for the 2 left, so the second token
    # went through the rejection sampler in every request the first did not end
    assert all(drafted == 1 for ids, drafted in results if len(ids) > 1)
    for position, expected in ((0, first), (1, second)):
        tokens = [ids[position] for ids, _ in results if len(ids) > position]
        counts = torch.bincount(torch.tensor(tokens), minlength=target.vocab_size).double()
        expected_counts = expected / expected.sum() * len(tokens)
        kept = expected_counts > 5  # chi-square needs populated cells: pool the rare tokens into one
        observed = torch.cat([counts[kept], counts[~kept].sum().reshape(1)])
        wanted = torch.cat([expected_counts[kept], expected_counts[~kept].sum().reshape(1)])
        result = chisquare(observed.numpy(), wanted.numpy() * observed.sum().item() / wanted.sum().item())
        assert result.pvalue > 1e-3, f"token {position + 1}: counts {counts.tolist()}"


def test_a_cancelled_stream_leaves_no_session_behind_on_either_service(stack, client):
    stream = client.stream([4, 5, 6], max_new_tokens=200, num_speculative_tokens=2)
    next(stream)
    stream.cancel()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(open_sessions(stack)):
        time.sleep(0.2)
    assert open_sessions(stack) == (0, 0)


def open_sessions(stack) -> tuple[int, int]:
    counts = []
    for name, stub_type in (("draft", drafter_pb2_grpc.DrafterStub), ("verify", verifier_pb2_grpc.VerifierStub)):
        with grpc.insecure_channel(stack.services[name].address) as channel:
            counts.append(stub_type(channel).Info(common_pb2.InfoRequest(), timeout=10).active_sessions)
    return counts[0], counts[1]
