"""A stack under a KV cache budget: a burst of far more requests than fit either finishes exactly or is refused
with RESOURCE_EXHAUSTED, both services keep serving, and pre-drafting lanes stay exact on shared blocks."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.client import Client
from specdec.decoding.reference_loop import target_only_generate
from specdec.engine.kv.budget import block_bytes
from specdec.engine.model_runtime import LoadedModel, ModelSettings
from specdec.local_stack import LocalStack
from specdec.sampling.rules import SamplingParams
from specdec.v1 import common_pb2, drafter_pb2_grpc, verifier_pb2_grpc

MAX_SESSIONS = 4
MAX_NEW = 24
PROMPT_LENGTH = 10
GAMMA = 4


@pytest.fixture(scope="module")
def target(long_pair_dirs) -> LoadedModel:
    return LoadedModel.load(ModelSettings(str(long_pair_dirs[0])))


def prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 64) for _ in range(PROMPT_LENGTH)] for _ in range(count)]


def serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def kv_info(stack: LocalStack) -> dict[str, common_pb2.ServiceInfo]:
    infos = {}
    for name, stub_type in (("draft", drafter_pb2_grpc.DrafterStub), ("verify", verifier_pb2_grpc.VerifierStub)):
        with grpc.insecure_channel(stack.services[name].address) as channel:
            infos[name] = stub_type(channel).Info(common_pb2.InfoRequest(), timeout=10)
    return infos


def test_a_burst_of_four_times_max_sessions_finishes_exactly_or_is_refused(long_pair_dirs, target):
    """16 requests at once against max_sessions 4 and a budget of 12 blocks of 16 positions per service: what a
    quarter of the burst holds on the verifier at full length (3 blocks each). The drafter's 9 lanes per request
    need more than that, so drafters refuse or end sessions and those requests finish by plain decoding; past
    max_sessions the verifier refuses at once (its KV queue is for sessions it may hold)."""
    target_dir, draft_dir = long_pair_dirs
    budget = str(12 * block_bytes(target.model.config, torch.float32, 16))
    limits = ["--kv-cache-budget", budget, "--max-sessions", str(MAX_SESSIONS)]
    draft_limits = [*limits, "--kv-admission-wait-ms", "300"]
    burst = prompts(4 * MAX_SESSIONS, seed=7)
    with (
        LocalStack(
            str(target_dir), str(draft_dir), draft_limits, limits, coordinator_args=["--no-adaptive-gamma"]
        ) as stack,
        Client(stack.address, timeout_s=120) as client,
    ):

        def run(prompt: list[int]):
            try:
                return client.generate(prompt, max_new_tokens=MAX_NEW, num_speculative_tokens=GAMMA)
            except grpc.RpcError as error:
                return error

        with ThreadPoolExecutor(len(burst)) as pool:
            replies = list(pool.map(run, burst))
        finished = 0
        for prompt, reply in zip(burst, replies):
            if isinstance(reply, grpc.RpcError):
                assert reply.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, reply.details()
                continue
            finished += 1
            assert list(reply.token_ids) == target_only_generate(target, prompt, SamplingParams(), MAX_NEW).token_ids
        assert finished >= 1
        assert serving(stack.services["draft"].address) and serving(stack.services["verify"].address)
        after = list(client.generate(burst[0], max_new_tokens=MAX_NEW, num_speculative_tokens=GAMMA).token_ids)
        assert after == target_only_generate(target, burst[0], SamplingParams(), MAX_NEW).token_ids
        deadline = time.monotonic() + 30  # sessions close after their replies: every block comes back
        while any(info.kv_blocks_used for info in kv_info(stack).values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        infos = kv_info(stack)
        assert [(i.active_sessions, i.kv_block_size, i.kv_blocks_used, i.kv_blocks_free) for i in infos.values()] == [
            (0, 16, 0, 12)
        ] * 2


def test_eight_concurrent_greedy_requests_with_overlap_and_predrafting_are_token_identical(long_pair_dirs, target):
    """Overlap and pre-drafting on a fixed γ: every request keeps 1 + 2γ draft lanes that share its prefix's
    blocks, and each lane's drafts still come from its own sequence."""
    target_dir, draft_dir = long_pair_dirs
    batch = prompts(8, seed=8)
    with (
        LocalStack(
            str(target_dir), str(draft_dir), coordinator_args=["--no-adaptive-gamma", "--predraft-max-batch", "0"]
        ) as stack,
        Client(stack.address, timeout_s=120) as client,
        ThreadPoolExecutor(len(batch)) as pool,
    ):
        replies = list(
            pool.map(
                lambda prompt: client.generate(
                    prompt, max_new_tokens=MAX_NEW, num_speculative_tokens=GAMMA, include_stats=True
                ),
                batch,
            )
        )
    for prompt, reply in zip(batch, replies):
        assert list(reply.token_ids) == target_only_generate(target, prompt, SamplingParams(), MAX_NEW).token_ids
        stats = reply.stats
        assert stats.drafted_tokens > 0 and stats.predraft_guesses > stats.predraft_attempts > 0  # several lanes
