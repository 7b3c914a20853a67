"""One request's draft -> verify -> commit rounds across a draft and a verify replica.

Sequential mode: Propose(block k) then Verify(block k). Overlapped mode: while Verify(block k) runs, the drafter
already drafts block k+1 under guessed verdicts of block k (coordinator/predrafter.py); a verdict that matches a
guess sends that block straight to the verifier, otherwise the next block is drafted afresh. Draws are keyed by
(seed, position), so both modes commit the same tokens.

The verifier's open draws the first token from its prefill (docs/architecture.md, "The first token"): it is
committed and streamed before the drafter's open is awaited. Then each loop iteration is one round: [propose block
k,] verify block k (pre-drafting block k+1 meanwhile), commit.
The parts of a request share its GenerationState (coordinator/generation_state.py): its sessions on the replicas
(coordinator/replica_sessions.py), its rounds' calls to them (coordinator/round_calls.py), the sizes of its blocks
(coordinator/block_sizing.py) and its pre-drafts.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

from opentelemetry.context import Context

from coordinator.block_sizing import BlockSizer
from coordinator.generation_state import GenerationState
from coordinator.predrafter import Predrafter
from coordinator.replica_sessions import ReplicaSessions
from coordinator.replicas import Replica
from coordinator.request_plan import GenerationPlan
from coordinator.request_stats import RequestStats
from coordinator.request_telemetry import RequestTelemetry
from coordinator.round_blocks import ChainedRound, DraftBlock
from coordinator.round_calls import RoundCalls
from coordinator.session_moves import Placement, SessionMoves
from coordinator.speculation_gate import SpeculationGate
from coordinator.speculation_policy import AcceptanceRate, RoundTimes
from coordinator.text_stream import CONSTRAINT_DEAD_END, Chunk, TextStream
from specdec.v1 import verifier_pb2


class Generation:
    """Runs one request on one draft and one verify replica, yielding a Chunk per committed round."""

    def __init__(
        self,
        plan: GenerationPlan,
        draft: Replica | None,
        verify: Replica,
        text: TextStream,
        call_timeout_s: float,
        telemetry: RequestTelemetry | None = None,
        on_draft_unavailable: Callable[[Replica], None] | None = None,
        acceptance: AcceptanceRate | None = None,
        round_times: RoundTimes | None = None,
        gate: SpeculationGate | None = None,
        placement: Placement | None = None,
        deadline: float | None = None,
    ):
        self.plan = plan
        self.text = text
        self.gate = gate  # coordinator-wide measured throughput each way; None: the γ policy alone decides
        self.telemetry = telemetry or RequestTelemetry()
        self.stats = RequestStats()
        self.state = GenerationState(plan, self.stats, self.telemetry)
        moves = (
            SessionMoves(placement, plan.request_id, call_timeout_s, self.stats, self.telemetry.metrics)
            if placement is not None
            else None
        )  # sessions move off replicas that fail or drain (coordinator/session_moves.py)
        self.sessions = ReplicaSessions(
            self.state, draft, verify, call_timeout_s, on_draft_unavailable, moves, deadline
        )
        self.calls = RoundCalls(self.state, self.sessions)
        self.sizing = BlockSizer(self.state, self.sessions, acceptance, round_times, gate)
        self.predrafter = Predrafter(self.state, self.sessions, self.calls, self.sizing)

    def elapsed_ns(self) -> int:
        """Time since the request started."""
        return self.state.elapsed_ns()

    async def chunks(self) -> AsyncIterator[Chunk]:
        """Opens both sessions, runs rounds until a stop rule fires, and always closes the sessions."""
        plan = self.plan
        with self.telemetry.request(plan.request_id, len(plan.prompt_ids), plan.gamma, plan.overlap):
            if self.gate is not None:
                self.gate.enter()
            try:
                first = self._commit_first_token(await self.sessions.open())
                self.telemetry.emitted(len(first.token_ids))
                yield first
                if first.finish_reason or self.state.remaining <= 0:
                    return
                await self.sessions.drafter_opened()
                async with contextlib.aclosing(self._rounds()) as rounds:  # ends after the chunk with a finish reason
                    async for chunk in rounds:
                        self.telemetry.emitted(len(chunk.token_ids))
                        yield chunk
            finally:
                if self.gate is not None:
                    self.gate.leave()
                self.stats.total_ns = self.elapsed_ns()
                await asyncio.shield(self.sessions.close())
                stats = self.stats
                self.telemetry.finished(
                    self.text.finish_reason or "incomplete",
                    rounds=stats.rounds,
                    drafted_tokens=stats.drafted,
                    accepted_tokens=stats.accepted,
                    generated_tokens=len(self.text.token_ids),
                )

    async def _rounds(self) -> AsyncIterator[Chunk]:
        block: DraftBlock | None = None
        chained: ChainedRound | None = None  # the verifier already runs `block` (chained mode)
        waiting_since = time.perf_counter_ns()  # a round's time runs from the previous verdict to its own
        while True:
            with self.telemetry.round() as round_span:
                if block is None:
                    block = await self._sync_and_propose(round_span)
                predraft = self.predrafter.start(block, round_span)
                next_call = self.predrafter.next_call_hint(block, predraft)
                try:
                    verdict = await self.calls.verify(block, round_span, next_call, chained)
                except BaseException:
                    if predraft is not None:
                        predraft.cancel()
                    raise
                self.sizing.time_round(len(block.token_ids), waiting_since)
                chunk = self._commit(block, verdict, round_span)
                finished = bool(chunk.finish_reason) or self.state.remaining <= 0
                if finished and predraft is not None:
                    # Not needed: cancelled before the last chunk (and its stats) go out, so neither counts it.
                    predraft.cancel()
                    await asyncio.gather(
                        predraft.future, *[predraft.next_round] if predraft.next_round else [], return_exceptions=True
                    )
                yield chunk
                if finished:
                    return
                waiting_since = time.perf_counter_ns()
                block, chained = await self.predrafter.next_round(predraft, verdict)

    def _commit_first_token(self, opened: verifier_pb2.OpenVerifySessionResponse) -> Chunk:
        """The first token, drawn by the verifier from its prefill, committed as the verdict of a plain round (none
        where the constraint allows none: the request ends)."""
        verdict = verifier_pb2.VerifyResponse(
            next_token_id=opened.first_token_id,
            constraint_dead_end=opened.constraint_dead_end,
            logprobs=[opened.first_token_logprob] if opened.HasField("first_token_logprob") else [],
        )
        with self.telemetry.round() as round_span:
            return self._commit(DraftBlock([], None), verdict, round_span)

    async def _sync_and_propose(self, round_span: Context) -> DraftBlock:
        """Drafts the next block afresh, on the lane that needs the least syncing to the committed sequence."""
        num_tokens = self.sizing.block_size(0, self.sizing.gamma())
        if self.sessions.draft is None or num_tokens == 0:
            return DraftBlock([], None)
        committed = self.state.committed
        lane = max(self.state.lanes, key=lambda candidate: candidate.sync_to(committed)[0])
        call = self.sizing.lane_call(lane, list(committed), 0, num_tokens, bonus=False)
        [block] = await self.calls.propose([call], round_span)
        return block

    def _commit(self, block: DraftBlock, verdict: verifier_pb2.VerifyResponse, round_span: Context) -> Chunk:
        """Appends the accepted tokens and the recovered/bonus token; the rejected rest is rolled back
        (the verifier already truncated; each draft lane truncates on its next call's base_len)."""
        drafted, accepted = len(block.token_ids), len(verdict.accepted_token_ids)
        committed = self.state.committed
        with self.telemetry.stage(
            "commit",
            round_span,
            base_len=len(committed),
            drafted=drafted,
            accepted=accepted,
            rolled_back=drafted - accepted,
        ):
            self.stats.record(drafted, accepted)
            self.state.verdicts.observe(drafted, block.alternatives, accepted, verdict.next_token_id)
            self.state.metrics.round_committed(drafted, accepted)
            self.sizing.observe_verdict(drafted, accepted)
            dead_end = verdict.constraint_dead_end  # the constraint allows nothing more: the request ends
            tokens = [*verdict.accepted_token_ids, *([] if dead_end else [verdict.next_token_id])]
            committed.extend(tokens)
            if self.gate is not None:
                self.gate.committed(len(tokens))
            chunk = self.text.add(tokens, ended=CONSTRAINT_DEAD_END if dead_end else None)
            chunk.logprobs = verdict.logprobs[: len(chunk.token_ids)]  # the tokens a stop rule kept
            return chunk
