"""The stack with both services' passes in model processes (--model-process): the same tokens as in process."""

from __future__ import annotations

import concurrent.futures
import os
import pathlib
import random
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from seeded_reference import assert_seeded_requests_equal_the_reference

from specdec.client import Client
from specdec.decoding.reference_loop import target_only_generate
from specdec.engine.model_runtime import LoadedModel, ModelSettings
from specdec.local_stack import LocalStack, start_service
from specdec.sampling.rules import SamplingParams
from specdec.v1 import verifier_pb2, verifier_pb2_grpc
from verify_service.settings import VerifySettings

MAX_NEW = 24


@pytest.fixture(scope="module")
def client(tiny_pair_dirs):
    target_dir, draft_dir = tiny_pair_dirs
    passes = ["--model-process"]
    with (
        LocalStack(str(target_dir), str(draft_dir), passes, passes, ["--no-adaptive-gamma"]) as stack,
        Client(stack.address, timeout_s=60) as running,
    ):
        yield running


@pytest.fixture(scope="module")
def models(tiny_pair_dirs):
    target_dir, draft_dir = tiny_pair_dirs
    return LoadedModel.load(ModelSettings(str(target_dir))), LoadedModel.load(ModelSettings(str(draft_dir)))


def _prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 64) for _ in range(rng.randint(2, 30))] for _ in range(count)]


def test_concurrent_greedy_requests_are_token_identical_to_target_only(client, models):
    """Plain and speculative requests at once: batched passes, lane forks (copy-on-write) and rollbacks."""
    target, _ = models
    prompts = _prompts(8, seed=1)
    expected = [target_only_generate(target, prompt, SamplingParams(), MAX_NEW).token_ids for prompt in prompts]
    gammas = [0, 1, 4, 6]

    def generate(index: int):
        return client.generate(prompts[index], max_new_tokens=MAX_NEW, num_speculative_tokens=gammas[index % 4])

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(generate, range(len(prompts))))
    assert [list(reply.token_ids) for reply in replies] == expected


def test_seeded_sampled_requests_equal_the_in_process_reference(client, models):
    prompts = [_prompts(1, seed=100 + seed)[0] for seed in range(3)]
    assert_seeded_requests_equal_the_reference([client], *models, prompts, MAX_NEW)


def test_tensor_parallel_ranks_refuse_a_model_process_naming_it():
    with pytest.raises(ValueError, match="model_process"):
        VerifySettings(model_process=True, tensor_parallel_size=2)


def _serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def _model_process_of(pid: int) -> int:
    """The spawned model process among a service's children (not multiprocessing's resource tracker)."""
    children = pathlib.Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    for child in map(int, children):
        command = pathlib.Path(f"/proc/{child}/cmdline").read_bytes()
        if b"spawn_main" in command and b"resource_tracker" not in command:
            return child
    raise AssertionError(f"no model process among {children}")


def test_a_verify_service_whose_model_process_dies_stops_serving(tiny_pair_dirs, tmp_path):
    service = start_service(
        "verify", "verify_service", ["--model", str(tiny_pair_dirs[0]), "--model-process"], tmp_path
    )
    try:
        assert _serving(service.address)
        os.kill(_model_process_of(service.process.pid), signal.SIGKILL)
        deadline = time.monotonic() + 30
        while _serving(service.address) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _serving(service.address)
        with grpc.insecure_channel(service.address) as channel:
            open_session = verifier_pb2_grpc.VerifierStub(channel).OpenSession
            with pytest.raises(grpc.RpcError) as failure:
                open_session(
                    verifier_pb2.OpenVerifySessionRequest(session_id="s", prompt_token_ids=[1, 2, 3]), timeout=10
                )
        assert failure.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "model process is gone" in failure.value.details()
    finally:
        service.stop()
