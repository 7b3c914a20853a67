"""No session outlives its request: streams cancelled at random points leave nothing on the replicas, and a close
that failed is tried again."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import random
import time

import grpc
import pytest
from transformers import AutoTokenizer

from coordinator import close_retry
from coordinator.generation_state import GenerationState
from coordinator.replica_sessions import ReplicaSessions
from coordinator.replicas import Replica, ReplicaPool
from coordinator.request_plan import GenerationPlan
from coordinator.request_stats import RequestStats
from coordinator.request_telemetry import RequestTelemetry
from coordinator.servicer import CoordinatorServicer
from coordinator.settings import CoordinatorSettings
from specdec.client import Client, build_request
from specdec.local_stack import LocalStack
from specdec.sampling.rules import SamplingParams
from specdec.v1 import common_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc

CANCELLED_STREAMS = 50


@pytest.fixture(scope="module")
def stack(long_pair_dirs):
    target_dir, draft_dir = long_pair_dirs
    with LocalStack(str(target_dir), str(draft_dir), coordinator_args=["--max-new-tokens-limit", "200"]) as running:
        yield running


def replica_load(stack) -> list[tuple[int, int]]:
    """(active_sessions, kv_cache_tokens) of the draft and the verify service."""
    loads = []
    for name, stub_type in (("draft", drafter_pb2_grpc.DrafterStub), ("verify", verifier_pb2_grpc.VerifierStub)):
        with grpc.insecure_channel(stack.services[name].address) as channel:
            info = stub_type(channel).Info(common_pb2.InfoRequest(), timeout=10)
            loads.append((info.active_sessions, info.kv_cache_tokens))
    return loads


def cancel_one(client: Client, rng: random.Random) -> None:
    """A stream cancelled after a random number of chunks (0: while its sessions open)."""
    stream = client.stream(
        [rng.randrange(1, 64) for _ in range(rng.randint(2, 12))],
        max_new_tokens=200,
        num_speculative_tokens=rng.choice([0, 1, 3, 5]),
        temperature=rng.choice([0.0, 1.0]),
    )
    try:
        for _ in range(rng.choice([0, 0, 1, 2, 5, 12])):
            next(stream)
    except StopIteration:
        pass
    stream.cancel()


def test_streams_cancelled_at_random_points_leave_no_session_or_kv_behind(stack):
    rng = random.Random(7)
    rngs = [random.Random(rng.random()) for _ in range(CANCELLED_STREAMS)]
    with Client(stack.address, timeout_s=60) as client, concurrent.futures.ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda r: cancel_one(client, r), rngs))
        for _ in range(50):  # within 5 s
            if replica_load(stack) == [(0, 0), (0, 0)]:
                break
            time.sleep(0.1)
        assert replica_load(stack) == [(0, 0), (0, 0)]
        assert client.generate([1, 2], max_new_tokens=3).token_ids  # still serving


class FlakyCloseStub:
    """A replica whose first CloseSession fails UNAVAILABLE and whose later ones succeed."""

    def __init__(self):
        self.closes: list[str] = []

    async def CloseSession(self, request, timeout=None):
        self.closes.append(request.session_id)
        if len(self.closes) == 1:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "restarting"
            )
        return common_pb2.CloseSessionResponse(closed=True)


def test_a_failed_close_is_retried_once_in_the_background(monkeypatch):
    monkeypatch.setattr(close_retry, "CLOSE_RETRY_DELAY_S", 0.01)
    verify, draft = FlakyCloseStub(), FlakyCloseStub()

    async def scenario() -> None:
        plan = GenerationPlan("req-1", [1, 2, 3], 8, SamplingParams(), 2, 0, overlap=False, call_streams=False)
        state = GenerationState(plan, RequestStats(), RequestTelemetry())
        sessions = ReplicaSessions(state, Replica("draft:1", None, draft), Replica("verify:1", None, verify), 5)
        sessions._draft_opening = True  # its draft session was opened (after the first token)
        await sessions.close()
        assert verify.closes == ["req-1"] and draft.closes == ["req-1"]
        await asyncio.gather(*close_retry._retries)

    asyncio.run(scenario())
    assert verify.closes == ["req-1", "req-1"] and draft.closes == ["req-1", "req-1"]


class FakeVerifier:
    """A verify replica in-process: opens, answers every Verify with one plain-step token, records closes."""

    def __init__(self):
        self.open: set[str] = set()

    async def OpenSession(self, request, timeout=None):
        self.open.add(request.session_id)
        return verifier_pb2.OpenVerifySessionResponse(session_len=len(request.prompt_token_ids))

    async def Verify(self, request, timeout=None):
        return verifier_pb2.VerifyResponse(next_token_id=5, session_len=request.base_len + 1)

    async def CloseSession(self, request, timeout=None):
        self.open.discard(request.session_id)
        return common_pb2.CloseSessionResponse(closed=True)


@pytest.mark.parametrize("method", ["GenerateStream", "replies"])
def test_a_stream_closed_by_its_consumer_closes_its_sessions_at_once(tiny_pair_dirs, method):
    """The consumer stops (as gRPC does on a cancel, or an outer layer's aclose): the sessions are closed before
    aclose() returns, not when the garbage collector finds the abandoned inner generators."""
    target_dir, _ = tiny_pair_dirs
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    settings = CoordinatorSettings(
        overlap=False,
        adaptive_gamma=False,
        max_new_tokens_limit=100,
        call_streams=False,  # fake replicas: unary calls
    )
    request = build_request([1, 2, 3], max_new_tokens=100, num_speculative_tokens=0)

    async def scenario() -> None:
        verifier = FakeVerifier()
        verify_pool = ReplicaPool("verify", ["127.0.0.1:9"], lambda channel: verifier)
        draft_pool = ReplicaPool("draft", ["127.0.0.1:9"], lambda channel: None)
        servicer = CoordinatorServicer(settings, tokenizer, set(), 64, draft_pool, verify_pool)
        stream = servicer.GenerateStream(request, None) if method == "GenerateStream" else servicer._run(request)
        await stream.__anext__()
        assert len(verifier.open) == 1
        gc.disable()  # what the garbage collector would do later must not count
        try:
            await stream.aclose()
            assert verifier.open == set() and verify_pool.replicas[0].active_sessions == 0
        finally:
            gc.enable()
        await asyncio.gather(draft_pool.close(), verify_pool.close())

    asyncio.run(scenario())


class InFlightOpenReplica:
    """A replica in-process whose OpenSession, once sent, runs to its end whatever the caller does (as a server may
    with a request already on the wire); it answers when `answer` is set."""

    def __init__(self):
        self.answer = asyncio.Event()
        self.open: set[str] = set()
        self._serving: set[asyncio.Task] = set()

    async def OpenSession(self, request, timeout=None):
        async def serve():
            await self.answer.wait()
            self.open.add(request.session_id)
            return verifier_pb2.OpenVerifySessionResponse(session_len=len(request.prompt_token_ids))

        serving = asyncio.ensure_future(serve())
        self._serving.add(serving)
        return await asyncio.shield(serving)

    async def CloseSession(self, request, timeout=None):
        closed = request.session_id in self.open
        self.open.discard(request.session_id)
        return common_pb2.CloseSessionResponse(closed=closed)


def test_a_request_cancelled_while_its_sessions_open_closes_them_after_they_opened():
    """The close must not overtake the open it follows: a request cancelled while its opens are in flight waits for
    them to answer, then closes both sessions."""
    draft, verify = InFlightOpenReplica(), InFlightOpenReplica()

    async def scenario() -> None:
        plan = GenerationPlan("req-1", [1, 2, 3], 8, SamplingParams(), 2, 0, overlap=False, call_streams=False)
        state = GenerationState(plan, RequestStats(), RequestTelemetry())
        sessions = ReplicaSessions(state, Replica("draft:1", None, draft), Replica("verify:1", None, verify), 5)

        async def request() -> None:
            try:
                await sessions.open()
            finally:
                await asyncio.shield(sessions.close())

        running = asyncio.ensure_future(request())
        await asyncio.sleep(0.01)  # both opens sent
        running.cancel()
        await asyncio.sleep(0.01)
        for replica in (draft, verify):
            replica.answer.set()
        with pytest.raises(asyncio.CancelledError):
            await running

    asyncio.run(scenario())
    assert draft.open == set() and verify.open == set()
