"""The verify service at tensor-parallel size 2 on CPU (gloo), ranks started as local processes and as Ray actors.

Through the real gRPC stack: greedy output token-identical to TP = 1, sessions, rollback and concurrent
requests (8 at once, batched into shared passes, overlap on); in process: one control message per step whatever
the batch size; and a worker rank that is killed (local ranks) or hangs (Ray ranks) mid-request turns the service
NOT_SERVING and fails the request UNAVAILABLE within a bound. The TP = 1 side is the in-process target (the path
the TP = 1 service runs, checked by tests/coordinator/test_end_to_end.py).
"""

from __future__ import annotations

import concurrent.futures
import os
import random
import re
import signal
import time
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.client import Client
from specdec.common.errors import StaleBaseLenError
from specdec.decoding.reference_loop import target_only_generate
from specdec.engine.model_runtime import LoadedModel, ModelSettings
from specdec.local_stack import ServiceProcess, start_service
from specdec.sampling.rules import SamplingParams
from specdec.serving.health_status import LIVENESS
from specdec.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from verify_service.rank_launchers import LocalLauncher
from verify_service.service import OPEN, VERIFY, Opened, VerifyService
from verify_service.settings import VerifySettings
from verify_service.tensor_parallel import TensorParallelLeader

MAX_NEW = 16
TP_TIMEOUT_S = 5.0
TP2 = ["--tensor-parallel-size", "2", "--threads", "1", "--tp-timeout-s", str(TP_TIMEOUT_S)]


def random_prompts(count: int, seed: int, max_len: int = 10) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 64) for _ in range(rng.randint(2, max_len))] for _ in range(count)]


@pytest.fixture(scope="module")
def target(tiny_pair_dirs) -> LoadedModel:
    """The target at TP = 1, in this process."""
    return LoadedModel.load(ModelSettings(str(tiny_pair_dirs[0])))


@pytest.fixture(scope="module")
def draft(tiny_pair_dirs, tmp_path_factory) -> ServiceProcess:
    """One draft service for both stacks (what LocalStack starts, minus a second draft start-up)."""
    service = start_service(
        "draft",
        "draft_service",
        ["--model", str(tiny_pair_dirs[1]), "--threads", "1"],
        tmp_path_factory.mktemp("tp-draft"),
    )
    yield service
    service.stop()


@dataclass
class Stack:
    """A TP = 2 verify service (ranks started by `launcher`) and a coordinator in front of it and the draft."""

    launcher: str
    verify: ServiceProcess
    coordinator: ServiceProcess


@pytest.fixture(scope="module", params=["local", "ray"])
def stack(request, tiny_pair_dirs, draft, tmp_path_factory) -> Stack:
    target_dir = str(tiny_pair_dirs[0])
    log_dir = tmp_path_factory.mktemp(f"tp-{request.param}")
    verify = start_service(
        "verify", "verify_service", ["--model", target_dir, *TP2, "--tp-launcher", request.param], log_dir
    )
    try:
        coordinator = start_service(
            "coordinator",
            "coordinator",
            ["--tokenizer", target_dir, "--draft-replicas", draft.address, "--verify-replicas", verify.address],
            log_dir,
        )
    except BaseException:
        verify.stop()
        raise
    yield Stack(request.param, verify, coordinator)
    coordinator.stop()
    verify.stop()


@pytest.fixture(scope="module")
def client(stack):
    with Client(stack.coordinator.address, timeout_s=60) as c:
        yield c


@pytest.fixture(scope="module")
def verifier(stack):
    with grpc.insecure_channel(stack.verify.address) as channel:
        yield verifier_pb2_grpc.VerifierStub(channel), health_pb2_grpc.HealthStub(channel)


def health_status(health: health_pb2_grpc.HealthStub, service: str = "") -> int:
    return health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def test_greedy_output_is_token_identical_to_tp1_on_ten_prompts(client, verifier, target):
    stub, _ = verifier
    assert stub.Info(common_pb2.InfoRequest(), timeout=10).tensor_parallel_size == 2
    rejected = 0
    for index, prompt in enumerate(random_prompts(10, seed=7)):
        gamma = 1 + index % 4
        expected = target_only_generate(target, prompt, SamplingParams(), MAX_NEW).token_ids
        reply = client.generate(prompt, max_new_tokens=MAX_NEW, num_speculative_tokens=gamma, include_stats=True)
        assert list(reply.token_ids) == expected, f"prompt {prompt}, γ={gamma}"
        rejected += reply.stats.drafted_tokens - reply.stats.accepted_tokens
    assert rejected > 0  # some drafts were rejected, so the ranks rolled their caches back


def test_concurrent_requests_each_match_tp1(client, target):
    prompts = random_prompts(6, seed=21)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        replies = list(
            pool.map(lambda p: client.generate(p, max_new_tokens=MAX_NEW, num_speculative_tokens=3), prompts)
        )
    for prompt, reply in zip(prompts, replies):
        assert list(reply.token_ids) == target_only_generate(target, prompt, SamplingParams(), MAX_NEW).token_ids


def test_eight_concurrent_requests_of_different_lengths_share_passes_and_match_tp1(client, verifier, target):
    """Concurrency 8, prompts of 2 to 40 tokens, overlap and batching on (the coordinator's and verifier's
    defaults): every output is TP = 1's, and concurrent rounds share the verifier's passes."""
    prompts = random_prompts(8, seed=33, max_len=40)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        replies = list(
            pool.map(lambda p: client.generate(p, max_new_tokens=MAX_NEW, num_speculative_tokens=3), prompts)
        )
        for prompt, reply in zip(prompts, replies):
            assert list(reply.token_ids) == target_only_generate(target, prompt, SamplingParams(), MAX_NEW).token_ids
        stub, _ = verifier
        for index, prompt in enumerate(prompts):
            stub.OpenSession(
                verifier_pb2.OpenVerifySessionRequest(session_id=f"c8-{index}", prompt_token_ids=prompt), timeout=30
            )
        rounds = [
            verifier_pb2.VerifyRequest(session_id=f"c8-{index}", base_len=len(prompt), draft_token_ids=[1, 2, 3])
            for index, prompt in enumerate(prompts)
        ]
        verdicts = list(pool.map(lambda request: stub.Verify(request, timeout=30), rounds))
    assert max(verdict.batch_rows for verdict in verdicts) > 1
    for index in range(len(prompts)):
        stub.CloseSession(common_pb2.CloseSessionRequest(session_id=f"c8-{index}"), timeout=10)


def test_each_step_sends_one_control_message_whatever_its_batch_size(tiny_pair_dirs, target):
    """Rank 0 in this process, rank 1 spawned: steps of 1, 3 and 8 sessions (opens, rounds with rollbacks, opens
    packed into rounds' passes, closes between steps) each send exactly one message, and match TP = 1."""
    settings = VerifySettings(model=str(tiny_pair_dirs[0]), tensor_parallel_size=2, tp_timeout_s=60.0)
    leader = TensorParallelLeader.start(settings, LocalLauncher())
    try:
        sharded = VerifyService(settings, leader.model, leader)
        reference = VerifyService(VerifySettings(model=target.settings.model), target)
        rng = random.Random(5)
        greedy = SamplingParams()
        lengths: dict[str, int] = {}
        for batch in (1, 3, 8):
            opens = [(f"b{batch}-{i}", OPEN, prompt, greedy) for i, prompt in enumerate(random_prompts(batch, batch))]
            for step in range(4):
                rounds = [
                    (
                        session_id,
                        VERIFY,
                        max(1, length - rng.randint(0, 2)),
                        [rng.randrange(1, 64) for _ in range(3)],
                        None,
                    )
                    for session_id, length in lengths.items()
                ]  # every session rolls back 0 to 2 tokens first
                calls = rounds + (opens if step == 0 else [])
                sent = leader.steps_sent
                results = sharded.step_many(calls)
                assert leader.steps_sent - sent == 1, f"batch {batch}, step {step}: {len(calls)} calls"
                expected = reference.step_many(calls)
                for call, got, want in zip(calls, results, expected):
                    if call[1] == OPEN:  # opened, without a first token (the open did not ask for one)
                        assert isinstance(got, Opened) and isinstance(want, Opened), call
                        assert got.first is None and want.first is None, call
                        lengths[call[0]] = len(call[2])
                    else:  # (verdict, timing, length): all but the timing
                        assert (got[0], got[2]) == (want[0], want[2]), call
                        lengths[call[0]] = got[2]
            for session_id in list(lengths)[: batch // 2]:  # some close: their caches go with the next step
                assert sharded.close(session_id) and reference.close(session_id)
                del lengths[session_id]
        assert leader.failure is None
    finally:
        leader.close()


def test_interleaved_sessions_and_rollback_match_tp1(verifier, target):
    """The same open / verify / rollback / close calls on the TP = 2 service and on TP = 1 in process."""
    stub, health = verifier
    reference = VerifyService(VerifySettings(model=target.settings.model), target)
    greedy = SamplingParams()

    def both_open(session_id: str, prompt: list[int]) -> None:
        reply = stub.OpenSession(
            verifier_pb2.OpenVerifySessionRequest(session_id=session_id, prompt_token_ids=prompt), timeout=30
        )
        reference.open(session_id, prompt, greedy)
        assert reply.session_len == len(prompt)

    def both_verify(session_id: str, base_len: int, drafts: list[int]) -> verifier_pb2.VerifyResponse:
        reply = stub.Verify(
            verifier_pb2.VerifyRequest(session_id=session_id, base_len=base_len, draft_token_ids=drafts), timeout=30
        )
        verdict, _, session_len = reference.verify(session_id, base_len, drafts, None)
        assert (list(reply.accepted_token_ids), reply.next_token_id, reply.is_bonus, reply.session_len) == (
            verdict.accepted_tokens,
            verdict.next_token,
            verdict.is_bonus,
            session_len,
        ), (session_id, base_len, drafts)
        return reply

    both_open("a", [5, 9, 13, 2, 40])
    both_open("b", [7, 3, 11])
    first = both_verify("a", 5, [1, 2, 3, 4])
    both_verify("b", 3, [8, 8])
    both_verify("a", 5, [6, 6, 6])  # rollback: the committed token of round one is dropped
    continuation = target_only_generate(target, [5, 9, 13, 2, 40], greedy, 4).token_ids
    whole = both_verify("a", 5, continuation[:3])  # the target's own tokens: all accepted plus a bonus
    assert whole.is_bonus and list(whole.accepted_token_ids) == continuation[:3] and first.session_len == 6
    both_verify("b", 2, [])  # rollback into the prompt, then a plain decoding step
    both_verify("a", whole.session_len, [9, 9, 9, 9])
    with pytest.raises(grpc.RpcError) as stale:
        stub.Verify(verifier_pb2.VerifyRequest(session_id="b", base_len=50, draft_token_ids=[1]), timeout=30)
    assert stale.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(StaleBaseLenError):
        reference.verify("b", 50, [1], None)
    both_verify("b", 3, [4, 5, 6])  # a refused call sends nothing to the ranks: they are still in step
    for session_id in ("a", "b"):
        assert stub.CloseSession(common_pb2.CloseSessionRequest(session_id=session_id), timeout=10).closed
    assert not stub.CloseSession(common_pb2.CloseSessionRequest(session_id="a"), timeout=10).closed
    assert stub.Info(common_pb2.InfoRequest(), timeout=10).active_sessions == 0
    assert health_status(health) == health_pb2.HealthCheckResponse.SERVING


# ---------------------------------------------------------------------------------------------------------
# A worker rank that dies or hangs. This test breaks its stack, so it is the last one in this file: pytest
# runs the tests of one stack param in file order. Local ranks: rank 1 is killed mid-request. Ray ranks:
# rank 1 hangs (SIGSTOP) and the collective timeout ends the request.

FAILURE_BOUND_S = 10.0  # from the kill (or the end of tp_timeout_s) to UNAVAILABLE and NOT_SERVING


def verify_in_flight(stub, session_id: str) -> concurrent.futures.Future:
    pool = concurrent.futures.ThreadPoolExecutor(1)
    future = pool.submit(
        stub.Verify, verifier_pb2.VerifyRequest(session_id=session_id, base_len=5, draft_token_ids=[7, 7]), timeout=60
    )
    pool.shutdown(wait=False)
    return future


def test_a_failed_worker_rank_fails_the_request_unavailable_and_turns_the_service_not_serving(stack, verifier):
    stub, health = verifier
    service = stack.verify
    worker_pid = int(re.search(r"rank 1 pid (\d+)", service.log_path.read_text()).group(1))
    stub.OpenSession(
        verifier_pb2.OpenVerifySessionRequest(session_id="doomed", prompt_token_ids=[3, 1, 4, 1, 5]), timeout=30
    )
    kill = stack.launcher == "local"
    try:
        os.kill(worker_pid, signal.SIGSTOP)  # rank 1 freezes, so the next request is surely mid-flight
        started = time.monotonic()
        in_flight = verify_in_flight(stub, "doomed")
        if kill:
            time.sleep(0.5)
            assert not in_flight.done()
            os.kill(worker_pid, signal.SIGKILL)
            started = time.monotonic()
        with pytest.raises(grpc.RpcError) as raised:
            in_flight.result(timeout=FAILURE_BOUND_S + TP_TIMEOUT_S + 10)
        elapsed = time.monotonic() - started
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE, raised.value.details()
        assert elapsed < (FAILURE_BOUND_S if kill else TP_TIMEOUT_S + FAILURE_BOUND_S), f"failed after {elapsed:.1f}s"
        if not kill:
            assert elapsed >= TP_TIMEOUT_S * 0.9  # the timeout, not an error, ended it
        assert health_status(health) == health_pb2.HealthCheckResponse.NOT_SERVING
        # Liveness too: only a restart starts the group anew (kubelet's liveness probe reads this name).
        assert health_status(health, LIVENESS) == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as later:  # later calls fail at once
            stub.Verify(verifier_pb2.VerifyRequest(session_id="doomed", base_len=5, draft_token_ids=[1]), timeout=5)
        assert later.value.code() == grpc.StatusCode.UNAVAILABLE
        with (
            Client(stack.coordinator.address, timeout_s=30) as client,
            pytest.raises(grpc.RpcError) as through_coordinator,
        ):
            client.generate([1, 2, 3], max_new_tokens=4)
        assert through_coordinator.value.code() == grpc.StatusCode.UNAVAILABLE
        assert service.stop(timeout_s=TP_TIMEOUT_S + 20) == 0  # rank 0 still shuts down cleanly
        assert "process group destroyed" in service.log_path.read_text()
    finally:
        try:
            os.kill(worker_pid, signal.SIGKILL)
        except OSError:
            pass
