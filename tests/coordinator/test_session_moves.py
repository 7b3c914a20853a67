"""A request's sessions move off replicas that fail or drain: opened elsewhere with the committed tokens, the failed
call run again there, the placement counts and the closes following them; and where no replica can take them the
request fails (verify) or decodes plainly (draft)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from coordinator import close_retry
from coordinator.draft_lanes import DraftLane
from coordinator.generation_state import GenerationState
from coordinator.replica_sessions import ReplicaSessions
from coordinator.replicas import ReplicaPool
from coordinator.request_plan import GenerationPlan
from coordinator.request_stats import RequestStats
from coordinator.request_telemetry import RequestTelemetry
from coordinator.round_blocks import ChainedRound, DraftBlock, LaneCall
from coordinator.round_calls import RoundCalls
from coordinator.session_moves import Placement, SessionMoves
from specdec.common.errors import ReplicaUnreachableError
from specdec.sampling.rules import SamplingParams
from specdec.serving.wire import PLAIN_STEP
from specdec.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc

PROMPT = [1, 2, 3]


def unavailable() -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "gone")


class FakeReplica:
    """A replica's stub in-process: records opens (their tokens, whether they draw the first token) and closes; a
    verify open that draws the first token and Verify answer a plain step with token 7; `gone` fails every call
    UNAVAILABLE; `draining` says so in its replies."""

    def __init__(self, gone: bool = False, draining: bool = False):
        self.gone, self.draining = gone, draining
        self.opened: list[list[int]] = []
        self.drew_first_token: list[bool] = []
        self.closed: list[str] = []
        self.verified: list[int] = []  # base_len of each Verify

    async def OpenSession(self, request, timeout=None):
        if self.gone:
            raise unavailable()
        self.opened.append(list(request.prompt_token_ids))
        if not isinstance(request, verifier_pb2.OpenVerifySessionRequest) or not request.draw_first_token:
            return verifier_pb2.OpenVerifySessionResponse(session_len=len(request.prompt_token_ids))
        self.drew_first_token.append(True)
        return verifier_pb2.OpenVerifySessionResponse(session_len=len(request.prompt_token_ids) + 1, first_token_id=7)

    async def Verify(self, request, timeout=None):
        if self.gone:
            raise unavailable()
        self.verified.append(request.base_len)
        return verifier_pb2.VerifyResponse(next_token_id=7, session_len=request.base_len + 1, draining=self.draining)

    async def ProposeLanes(self, request, timeout=None):
        if self.gone:
            raise unavailable()
        return drafter_pb2.ProposeLanesResponse(lanes=[drafter_pb2.ProposeResponse(draft_token_ids=[9])])

    async def CloseSession(self, request, timeout=None):
        self.closed.append(request.session_id)
        return common_pb2.CloseSessionResponse(closed=True)


def pool(kind: str, fakes: list[FakeReplica]) -> ReplicaPool:
    stub = verifier_pb2_grpc.VerifierStub if kind == "verify" else drafter_pb2_grpc.DrafterStub
    replicas = ReplicaPool(kind, [f"127.0.0.1:{9 + i}" for i in range(len(fakes))], stub)
    for replica, fake in zip(replicas.replicas, fakes):
        replica.stub = fake
    return replicas


def request_on(
    drafts: ReplicaPool, verifies: ReplicaPool, max_moves: int = 4, committed: tuple[int, ...] = (4, 5)
) -> ReplicaSessions:
    """A request's sessions on the first replica of each pool, committed past its prompt by `committed`; its calls
    are unary (the fakes serve no call stream)."""
    plan = GenerationPlan("req", PROMPT, 16, SamplingParams(), 2, 0, overlap=False, call_streams=False)
    state = GenerationState(plan, RequestStats(), RequestTelemetry())
    state.committed.extend(committed)
    moves = SessionMoves(Placement(drafts, verifies, max_moves), "req", 5, state.stats, state.metrics)
    return ReplicaSessions(state, drafts.acquire(), verifies.acquire(), 5, moves=moves)


async def settled_closes() -> None:
    await asyncio.gather(*close_retry._retries)


def test_a_verify_session_whose_replica_is_gone_moves_with_the_committed_tokens_and_the_call_runs_again():
    gone, spare = FakeReplica(gone=True), FakeReplica()

    async def scenario() -> None:
        verifies, drafts = pool("verify", [gone, spare]), pool("draft", [FakeReplica()])
        sessions = request_on(drafts, verifies)
        request = verifier_pb2.VerifyRequest(session_id="req", base_len=5)
        reply = await sessions.call_verify("Verify", request)
        assert reply.next_token_id == 7 and sessions.verify is verifies.replicas[1]
        assert spare.opened == [[*PROMPT, 4, 5]] and spare.verified == [5]
        assert spare.drew_first_token == []  # the committed tokens hold the first token already
        assert [r.active_sessions for r in verifies.replicas] == [0, 1]
        assert not verifies.replicas[0].healthy and sessions.state.stats.verify_moves == 1
        await settled_closes()

    asyncio.run(scenario())


def test_a_verify_session_that_moves_while_opening_has_the_new_replica_draw_the_first_token_and_later_ones_not():
    gone, spare, third = FakeReplica(gone=True), FakeReplica(), FakeReplica()

    async def scenario() -> None:
        verifies, drafts = pool("verify", [gone, spare, third]), pool("draft", [FakeReplica()])
        sessions = request_on(drafts, verifies, committed=())
        opened = await sessions.open()
        await sessions.drafter_opened()
        assert opened.first_token_id == 7 and opened.session_len == len(PROMPT) + 1
        assert sessions.verify is verifies.replicas[1] and spare.opened == [PROMPT] and spare.drew_first_token == [True]
        sessions.state.committed.append(opened.first_token_id)  # committed: a later move reopens on it, drawing none
        assert await sessions.move_verify(sessions.verify, "failed")
        assert sessions.verify is verifies.replicas[2] and third.opened == [[*PROMPT, 7]]
        assert third.drew_first_token == [] and sessions.state.stats.verify_moves == 2
        await settled_closes()

    asyncio.run(scenario())


def test_with_no_other_healthy_verify_replica_the_call_fails_unavailable():
    async def scenario() -> None:
        verifies = pool("verify", [FakeReplica(gone=True), FakeReplica(gone=True)])
        sessions = request_on(pool("draft", [FakeReplica()]), verifies)
        with pytest.raises(ReplicaUnreachableError):
            await sessions.call_verify("Verify", verifier_pb2.VerifyRequest(session_id="req", base_len=5))
        assert sessions.state.stats.verify_moves == 0 and [r.healthy for r in verifies.replicas] == [False, False]

    asyncio.run(scenario())


def test_a_draining_verify_replica_loses_the_session_before_the_next_round_and_has_it_closed():
    draining, spare = FakeReplica(draining=True), FakeReplica()

    async def scenario() -> None:
        verifies = pool("verify", [draining, spare])
        sessions = request_on(pool("draft", [FakeReplica()]), verifies)
        calls = RoundCalls(sessions.state, sessions)
        hint = verifier_pb2.NextCallHint()
        await calls.verify(DraftBlock([], None), None, hint)
        sessions.state.committed.append(7)
        await calls.verify(DraftBlock([], None), None, hint)
        assert draining.verified == [5] and spare.verified == [6] and spare.opened == [[*PROMPT, 4, 5, 7]]
        await settled_closes()
        assert draining.closed == ["req"] and [r.active_sessions for r in verifies.replicas] == [0, 1]

    asyncio.run(scenario())


def test_a_chained_round_sent_before_the_session_moved_is_verified_anew_on_the_new_replica():
    draining, spare = FakeReplica(draining=True), FakeReplica()

    async def scenario() -> None:
        sessions = request_on(pool("draft", [FakeReplica()]), pool("verify", [draining, spare]))
        calls = RoundCalls(sessions.state, sessions)
        hint = verifier_pb2.NextCallHint()
        await calls.verify(DraftBlock([], None), None, hint)  # says it drains
        sessions.state.committed.append(7)
        ran_there = asyncio.get_running_loop().create_future()  # the old replica ran the next round by itself
        ran_there.set_result(
            verifier_pb2.VerifyNextResponse(
                ran=True, round_index=PLAIN_STEP, verdict=verifier_pb2.VerifyResponse(next_token_id=8, session_len=7)
            )
        )
        chained = ChainedRound(ran_there, PLAIN_STEP, sessions.verify_epoch)
        reply = await calls.verify(DraftBlock([], None), None, hint, chained)
        assert reply.next_token_id == 7 and spare.verified == [6] and sessions.verify_epoch == 2
        await settled_closes()

    asyncio.run(scenario())


def test_a_failed_drafter_hands_the_draft_session_to_another_while_the_request_decodes_plainly():
    failing, spare = FakeReplica(gone=True), FakeReplica()

    async def scenario() -> None:
        drafts = pool("draft", [failing, spare])
        sessions = request_on(drafts, pool("verify", [FakeReplica()]))
        calls = RoundCalls(sessions.state, sessions)
        lane = sessions.state.lanes[0]
        assert await sessions.without_draft_on_failure(sessions.call(sessions.draft, "ProposeLanes", None)) is None
        assert sessions.draft is None  # plain rounds until the move is done
        await sessions._draft_move
        assert sessions.draft is drafts.replicas[1] and spare.opened == [[*PROMPT, 4, 5]]
        assert sessions.state.lanes[0] == DraftLane(lane.index, [*PROMPT, 4, 5], 5)
        assert sessions.state.stats.draft_moves == 1 and [r.active_sessions for r in drafts.replicas] == [0, 1]
        [block] = await calls.propose([LaneCall(sessions.state.lanes[0], list(sessions.state.committed), 1)], None)
        assert block.token_ids == [9]

    asyncio.run(scenario())


def test_no_move_past_the_limit():
    async def scenario() -> None:
        verifies = pool("verify", [FakeReplica(gone=True), FakeReplica()])
        sessions = request_on(pool("draft", [FakeReplica()]), verifies, max_moves=0)
        with pytest.raises(ReplicaUnreachableError):
            await sessions.call_verify("Verify", verifier_pb2.VerifyRequest(session_id="req", base_len=5))

    asyncio.run(scenario())
