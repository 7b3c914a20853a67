"""A replica's error status reaches the client as the party it blames: the mapping, the drafter fallback, and
through real servers a verifier that lost the session and a drafter that does not serve the asked method."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from coordinator.generation_state import GenerationState
from coordinator.replica_errors import replica_error
from coordinator.replica_sessions import ReplicaSessions
from coordinator.replicas import Replica
from coordinator.request_plan import GenerationPlan
from coordinator.request_stats import RequestStats
from coordinator.request_telemetry import RequestTelemetry
from specdec.client import Client
from specdec.common.errors import InvalidFieldError, ReplicaFaultError, ReplicaUnreachableError
from specdec.local_stack import LocalStack
from specdec.sampling.rules import SamplingParams
from specdec.serving.grpc_errors import status_for
from specdec.v1 import common_pb2, verifier_pb2_grpc

Code = grpc.StatusCode


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


@pytest.mark.parametrize(
    "code, details, status, says",
    [
        (Code.UNAVAILABLE, "connection refused", Code.UNAVAILABLE, "verify replica h:1 Verify: UNAVAILABLE"),
        (Code.DEADLINE_EXCEEDED, "deadline", Code.UNAVAILABLE, "verify replica h:1 Verify: DEADLINE_EXCEEDED"),
        (Code.NOT_FOUND, "session_id: no session 's'", Code.UNAVAILABLE, "verify replica h:1 lost session 's'"),
        (Code.FAILED_PRECONDITION, "base_len: 9 is past session 's''s length 5", Code.INTERNAL, "out of sync"),
        (Code.INVALID_ARGUMENT, "draft_token_ids: 17 tokens exceed the limit of 16", Code.INTERNAL, "refused Verify"),
        (Code.RESOURCE_EXHAUSTED, "this replica holds its maximum of 2 sessions", Code.RESOURCE_EXHAUSTED, "h:1"),
        (Code.ALREADY_EXISTS, "session_id: 's' is already open", Code.INTERNAL, "ALREADY_EXISTS"),
    ],
)
def test_a_replicas_status_blames_the_right_party_and_names_the_replica(code, details, status, says):
    error = replica_error("verify", "h:1", "Verify", "s", rpc_error(code, details))
    assert status_for(error) == status and says in str(error) and details in str(error)
    if code == Code.NOT_FOUND:
        assert str(error).endswith("retry")


def test_a_refused_field_the_client_chose_stays_invalid_argument_naming_it():
    refused = rpc_error(Code.INVALID_ARGUMENT, "draft_method: 'model' is not served here (offered: ['ngram'])")
    error = replica_error("draft", "h:2", "OpenSession", "s", refused)
    assert isinstance(error, InvalidFieldError) and error.field == "draft_method"
    assert status_for(error) == Code.INVALID_ARGUMENT and "draft replica h:2" in str(error)
    assert str(error).startswith("draft_method: 'model' is not served here")


class FailingStub:
    """A replica stub whose calls fail with one status (the coordinator's view of a replica answering it)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        self.error = rpc_error(code, details)

    def __getattr__(self, method: str):
        async def call(request, timeout=None):
            raise self.error

        return call


def sessions_on(draft_stub, verify_stub) -> tuple[ReplicaSessions, list[str]]:
    """A request's sessions on fake replicas, and the addresses it took out of placement."""
    plan = GenerationPlan("req", [1, 2, 3], 8, SamplingParams(), 2, 0, overlap=False, call_streams=False)
    state = GenerationState(plan, RequestStats(), RequestTelemetry())
    unhealthy: list[str] = []
    sessions = ReplicaSessions(
        state,
        Replica("draft:1", None, draft_stub),
        Replica("verify:1", None, verify_stub),
        call_timeout_s=5,
        on_draft_unavailable=lambda replica: unhealthy.append(replica.address),
    )
    return sessions, unhealthy


@pytest.mark.parametrize(
    "code, leaves_placement",
    [
        (Code.FAILED_PRECONDITION, False),
        (Code.NOT_FOUND, False),
        (Code.INVALID_ARGUMENT, False),
        (Code.RESOURCE_EXHAUSTED, False),
        (Code.UNAVAILABLE, True),
    ],
)
def test_a_drafter_that_fails_is_dropped_for_plain_decoding(code, leaves_placement):
    sessions, unhealthy = sessions_on(FailingStub(code, "num_lanes: 9 is out of range 1..4"), None)

    async def propose():
        return await sessions.without_draft_on_failure(sessions.call(sessions.draft, "ProposeLanes", None))

    assert asyncio.run(propose()) is None
    assert sessions.draft is None and sessions.state.stats.draft_fallbacks == 1
    assert unhealthy == (["draft:1"] if leaves_placement else [])


def test_a_drafter_refusing_the_clients_draft_method_fails_the_request_naming_it():
    sessions, _ = sessions_on(FailingStub(Code.INVALID_ARGUMENT, "draft_method: 'model' is not served"), None)

    async def open_draft():
        return await sessions.without_draft_on_failure(sessions.call(sessions.draft, "OpenSession", None))

    with pytest.raises(InvalidFieldError) as raised:
        asyncio.run(open_draft())
    assert raised.value.field == "draft_method" and sessions.draft is not None


def test_verify_failures_are_raised_as_the_party_they_blame():
    async def verify(code, details):
        sessions, _ = sessions_on(None, FailingStub(code, details))
        await sessions.call(sessions.verify, "Verify", None)

    with pytest.raises(ReplicaFaultError, match="verify replica verify:1 Verify: out of sync"):
        asyncio.run(verify(Code.FAILED_PRECONDITION, "base_len: 9 is past session 'req''s length 5"))
    with pytest.raises(ReplicaUnreachableError) as raised:
        asyncio.run(verify(Code.UNAVAILABLE, "gone"))
    assert raised.value.address == "verify:1"


@pytest.fixture(scope="module")
def ngram_only_stack(long_pair_dirs):
    """A model-free drafter (n-gram only) and a verifier whose completions run their whole budget."""
    target_dir, _ = long_pair_dirs
    with LocalStack(
        str(target_dir),
        "",
        draft_args=["--vocab-size", "64", "--default-draft-method", "ngram"],
        coordinator_args=["--max-new-tokens-limit", "240", "--no-adaptive-gamma"],
    ) as stack:
        yield stack


def test_asking_a_drafter_for_a_method_it_does_not_serve_is_invalid_argument_naming_draft_method(ngram_only_stack):
    with Client(ngram_only_stack.address, timeout_s=60) as client, pytest.raises(grpc.RpcError) as raised:
        client.generate([1, 2, 3], max_new_tokens=4, draft_method=common_pb2.DRAFT_METHOD_MODEL)
    assert raised.value.code() == Code.INVALID_ARGUMENT
    assert raised.value.details().startswith("draft_method:") and "draft replica" in raised.value.details()


def test_a_verifier_that_lost_the_session_is_unavailable_with_a_retry_hint(ngram_only_stack):
    """The session vanishes from the verifier mid-stream (as after a restart): UNAVAILABLE, not NOT_FOUND (which
    would say the client named a session that does not exist)."""
    verify_address = ngram_only_stack.services["verify"].address
    with Client(ngram_only_stack.address, timeout_s=60) as client:
        stream = client.stream([1, 2, 3, 1, 2], max_new_tokens=240, num_speculative_tokens=0)
        session_id = next(stream).request_id  # no request_id of the client's: the session id
        with grpc.insecure_channel(verify_address) as channel:
            closed = verifier_pb2_grpc.VerifierStub(channel).CloseSession(
                common_pb2.CloseSessionRequest(session_id=session_id), timeout=10
            )
        assert closed.closed
        with pytest.raises(grpc.RpcError) as raised:
            for _ in stream:
                pass
    assert raised.value.code() == Code.UNAVAILABLE
    details = raised.value.details()
    assert f"verify replica {verify_address} lost session '{session_id}'" in details and details.endswith("retry")
    with Client(ngram_only_stack.address, timeout_s=60) as client:  # the replica still serves
        assert client.generate([1, 2], max_new_tokens=3).token_ids
