"""A round's calls to the replicas (Propose, Verify, VerifyNext), each counted where its figures go.

Stats, metrics and spans are fed from the same figures (coordinator/request_telemetry.py), every reply
refreshes its replica's measured pass cost at its current batch size, and every call's serialized request and
reply sizes add up to the request's wire bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from google.protobuf.message import Message
from opentelemetry.context import Context

from coordinator.generation_state import GenerationState
from coordinator.replica_sessions import ReplicaSessions
from coordinator.request_telemetry import RemoteCall
from coordinator.round_blocks import Candidate, ChainedRound, DraftBlock, LaneCall
from coordinator.session_moves import DRAINING
from specdec.common.errors import DownstreamUnavailableError
from specdec.v1 import drafter_pb2, verifier_pb2

log = logging.getLogger(__name__)


class RoundCalls:
    """Drafts and verifies one request's blocks on its sessions, and records each call."""

    def __init__(self, state: GenerationState, sessions: ReplicaSessions):
        self.state = state
        self.sessions = sessions

    async def propose(self, calls: Sequence[LaneCall], round_span: Context, predraft: bool = False) -> list[DraftBlock]:
        """Syncs and drafts the given lanes in one ProposeLanes call; empty blocks when the drafter has failed
        (the round becomes a plain step)."""
        blocks = await self.sessions.without_draft_on_failure(self._propose_on_drafter(calls, round_span, predraft))
        return blocks if blocks is not None else [DraftBlock([], None) for _ in calls]

    async def _propose_on_drafter(
        self, calls: Sequence[LaneCall], round_span: Context, predraft: bool
    ) -> list[DraftBlock]:
        draft, committed_len = self.sessions.draft, len(self.state.committed)
        if draft is None:  # the drafter failed or left since this call was made: the round is plain
            return [DraftBlock([], None) for _ in calls]
        alternatives = self.state.plan.ranked_alternatives
        proposals = []
        for call in calls:
            base_len, appended = call.lane.sync_to(call.sequence)
            proposals.append(
                drafter_pb2.LaneProposal(
                    lane=call.lane.index,
                    base_len=base_len,
                    appended_token_ids=appended,
                    num_speculative_tokens=call.num_tokens,
                    num_alternatives=alternatives,
                    num_lookup_tokens=call.lookup_tokens,
                    num_forced_tokens=call.forced_tokens,
                )
            )
        steps = max(call.num_tokens for call in calls)
        with self.state.telemetry.remote_call(
            "draft.propose", round_span, base_len=committed_len, num_tokens=steps, lanes=len(calls), predraft=predraft
        ) as remote:
            request = drafter_pb2.ProposeLanesRequest(
                session_id=self.state.plan.request_id, lanes=proposals, committed_len=committed_len
            )
            reply = await self.sessions.call(draft, "ProposeLanes", request)
            self._count_bytes(request, reply)
            draft_ns = reply.lanes[0].draft_ns if reply.lanes else 0
            remote.inside("draft.forward", "draft", draft_ns)
        self._count_call("draft", remote, draft=draft_ns)
        rows = reply.lanes[0].batch_rows if reply.lanes else 0
        if draft.load is not None and steps and rows:  # one pass per drafted position
            draft.load.observe(rows, draft_ns / steps, rows)
            draft.load.observe_call(remote.wire_ns)
        blocks = [DraftBlock.from_reply(lane_reply, call.lane.index) for call, lane_reply in zip(calls, reply.lanes)]
        if self.sessions.draft_holding_session is draft:  # not moved meanwhile: the lanes hold what it drafted
            for call, block in zip(calls, blocks):
                call.lane.synced(call.sequence, block.token_ids, committed_len)
        if reply.draining:
            self.sessions.leave_drafter(draft, DRAINING)
        return blocks

    async def verify(
        self,
        block: DraftBlock,
        round_span: Context,
        next_call: verifier_pb2.NextCallHint,
        chained: ChainedRound | None = None,
    ) -> verifier_pb2.VerifyResponse:
        """Verifies `block` (already running on the verifier when chained) and records the call. A verify session
        whose replica drains, is gone or lost it moves first (coordinator/session_moves.py)."""
        state = self.state
        await self.sessions.leave_draining_verifier()
        if chained is not None and chained.verify_epoch != self.sessions.verify_epoch:
            chained = None  # sent to a replica the session has left since: its verdict is not the session's
        with state.telemetry.remote_call(
            "verify", round_span, base_len=len(state.committed), num_tokens=len(block.token_ids)
        ) as call:
            reply = await self._chained_verdict(chained) if chained is not None else None
            call.span.set_attribute("specdec.chained", reply is not None)
            if reply is None:
                request = verifier_pb2.VerifyRequest(
                    session_id=state.plan.request_id,
                    base_len=len(state.committed),
                    draft_token_ids=block.token_ids,
                    draft_probs=block.probs,
                    next_call=next_call,
                )
                reply = await self.sessions.call_verify("Verify", request)
                self._count_bytes(request, reply)
            call.inside("verify.forward", "verify", reply.forward_ns)
            call.inside("verify.sampling", "verify", reply.sampling_ns)
        self._count_call("verify", call, verify=reply.forward_ns, sampling=reply.sampling_ns)
        verifier = self.sessions.verify
        if reply.draining:
            self.sessions.verify_drains(verifier)
        if verifier.load is not None:
            verifier.load.observe(reply.batch_tokens, reply.forward_ns, reply.batch_rows)
            verifier.load.observe_call(call.wire_ns)
        return reply

    async def verify_next(
        self,
        after_base_len: int,
        candidates: Sequence[Candidate],
        plain_otherwise: bool,
        round_span: Context,
        ends_request: bool = False,
    ) -> verifier_pb2.VerifyNextResponse:
        """Hands the verifier the candidate next rounds: it runs the one its pending verdict selects. The call's
        span sits in the round it was sent in; the round it runs records its verdict (`verify`, chained). Its hint
        says a round follows at once, or none when the round it runs ends the request. A verifier that is gone, or
        that the session moved off meanwhile, ran nothing the request uses: the round then goes as a plain Verify."""
        with self.state.telemetry.remote_call(
            "verify_next",
            round_span,
            after_base_len=after_base_len,
            candidates=len(candidates),
            plain_otherwise=plain_otherwise,
        ):
            request = verifier_pb2.VerifyNextRequest(
                session_id=self.state.plan.request_id,
                after_base_len=after_base_len,
                rounds=[
                    verifier_pb2.GuessedRound(
                        verdict=verifier_pb2.GuessedVerdict(num_accepted=c.num_accepted, next_token_id=c.next_token),
                        draft_token_ids=c.block.token_ids,
                        draft_probs=c.block.probs,
                    )
                    for c in candidates
                ],
                plain_otherwise=plain_otherwise,
                next_call=verifier_pb2.NextCallHint(after_any_verdict=not ends_request),
            )
            epoch = self.sessions.verify_epoch
            try:
                reply = await self.sessions.call(self.sessions.verify, "VerifyNext", request)
            except DownstreamUnavailableError:
                return verifier_pb2.VerifyNextResponse(ran=False)
            self._count_bytes(request, reply)
            return reply if epoch == self.sessions.verify_epoch else verifier_pb2.VerifyNextResponse(ran=False)

    async def _chained_verdict(self, chained: ChainedRound) -> verifier_pb2.VerifyResponse | None:
        """The verdict of the round the verifier ran by itself, or None if it ran another one or none (then the
        round is sent as a plain Verify, whose base_len rolls back whatever ran)."""
        answer = await chained.call
        if answer.ran and answer.round_index == chained.index:
            self.state.stats.chained_rounds += 1
            self.state.metrics.chained_rounds.inc()
            return answer.verdict
        log.warning(
            "request %s: the verifier ran round %s of a VerifyNext where %d was expected; verifying again",
            self.state.plan.request_id,
            answer.round_index if answer.ran else "none",
            chained.index,
        )
        return None

    def _count_bytes(self, request: Message, reply: Message) -> None:
        """Adds a round call's serialized request and reply sizes to the request's wire bytes."""
        self.state.stats.wire_bytes += request.ByteSize() + reply.ByteSize()

    def _count_call(self, label: str, call: RemoteCall, **stage_ns: int) -> None:
        """Adds one round call's service-side stage times and its wire time to the stats and the metrics."""
        stats, started_ns = self.state.stats, self.state.started_ns
        for stage, ns in stage_ns.items():
            setattr(stats, f"{stage}_ns", getattr(stats, f"{stage}_ns") + ns)
        stats.wire_ns += call.wire_ns
        stats.round_timeline.append((label, call.started_ns - started_ns, call.ended_ns - started_ns))
        self.state.metrics.stage_ns(wire=call.wire_ns, **stage_ns)
