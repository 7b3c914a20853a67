"""One request's draft -> verify -> commit rounds across a draft and a verify replica.

Sequential mode: Propose(block k) then Verify(block k). Overlapped mode: while Verify(block k) runs, the drafter
already drafts block k+1 under guessed verdicts of block k (coordinator/predrafting.py); a verdict that matches a
guess sends that block straight to the verifier, otherwise the next block is drafted afresh. Draws are keyed by
(seed, position), so both modes commit the same tokens.

Each loop iteration is one round: [propose block k,] verify block k (pre-drafting block k+1 meanwhile), commit.
The parts of a request share its GenerationState (coordinator/generation_state.py): its sessions on the replicas
(coordinator/replica_sessions.py), its rounds' calls to them (coordinator/round_calls.py), the sizes of its blocks
(coordinator/block_sizing.py) and its pre-drafts.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from opentelemetry.context import Context

from coordinator.block_sizing import BlockSizer
from coordinator.generation_state import GenerationState
from coordinator.predrafting import Predrafter
from coordinator.replica_sessions import ReplicaSessions
from coordinator.replicas import Replica
from coordinator.request_telemetry import RequestTelemetry
from coordinator.round_blocks import ChainedRound, DraftBlock, LaneCall
from coordinator.round_calls import RoundCalls
from coordinator.speculation_gate import SpeculationGate
from coordinator.speculation_policy import AcceptanceRate, RoundTimes
from coordinator.text_stream import Chunk, TextStream
from specdec.sampling import SamplingParams
from specdec.speculation_stats import SpeculationStats
from specdec.v1 import verifier_pb2

MAX_DRAFT_LANES = 16  # lanes one request may hold on a drafter (its default max_lanes); the least likely guesses go
MAX_RANKED_ALTERNATIVES = 8  # alternatives per drafted position a drafter ranks (its default max_alternatives)
EXTRA_RANKED_ALTERNATIVES = 2  # ranks considered for rejection guesses beyond the guesses per position


@dataclass(frozen=True)
class GenerationPlan:
    """A validated request, ready to run."""

    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    params: SamplingParams
    gamma: int  # 0 = plain target decoding through the verifier
    draft_method: int  # common_pb2.DraftMethod
    overlap: bool
    predraft_guesses: int = 2  # overlapped mode: rejection guesses per block position (0: only "all accepted")
    chain_rounds: bool = True  # overlapped mode: pre-drafted blocks go to the verifier as drafted (VerifyNext)
    lookup_tokens: int = 0  # greedy: lookup tokens a block may try after its drafted ones (specdec/prompt_lookup.py)

    @property
    def rejection_guesses(self) -> int:
        """Rejection guesses per block position: greedy and coupled requests only. There the verifier's token
        after a rejection is the target's argmax (of log p + g under the coupled rule), which the draft's ranking
        (of log q + g) often names; under the rejection rule it is a draw from the residual distribution, which
        the draft's ranking seldom names (pre-draft hit rate 0.08 at temperature 1 on the demo pair, against
        0.69 greedy), so those lanes would cost without paying."""
        guessable = self.params.greedy or self.params.coupled
        return self.predraft_guesses if self.overlap and guessable else 0

    @property
    def ranked_alternatives(self) -> int:
        """The draft's next most likely tokens per position that rejection guesses are chosen from: a few ranks
        deeper than the guesses per position, so a request whose verdicts keep landing deeper gets lanes there
        (coordinator/predraft.py: VerdictHistory)."""
        if not self.rejection_guesses:
            return 0
        return min(self.rejection_guesses + EXTRA_RANKED_ALTERNATIVES, MAX_RANKED_ALTERNATIVES)

    @property
    def draft_lanes(self) -> int:
        """Draft lanes the request holds: one per guess a pre-draft may make (one when not overlapped)."""
        return min(1 + self.gamma * self.rejection_guesses, MAX_DRAFT_LANES) if self.overlap and self.gamma else 1


@dataclass
class RequestStats(SpeculationStats):
    """Speculation counts plus where the time went (ns) and how pre-drafting fared."""

    draft_ns: int = 0
    verify_ns: int = 0
    sampling_ns: int = 0
    wire_ns: int = 0
    prefill_ns: int = 0
    total_ns: int = 0
    predraft_attempts: int = 0
    predraft_hits: int = 0
    predraft_guesses: int = 0  # guessed verdicts drafted, over all pre-drafted rounds
    chained_rounds: int = 0  # rounds the verifier ran right after the previous verdict (VerifyNext)
    draft_fallbacks: int = 0  # times the drafter failed and the request went on by plain decoding
    wire_bytes: int = 0  # serialized request + response bytes of the rounds' ProposeLanes, Verify, VerifyNext calls
    round_timeline: list[tuple[str, int, int]] = field(default_factory=list)  # (stage, start_ns, end_ns)


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
    ):
        self.plan = plan
        self.text = text
        self.gate = gate  # coordinator-wide measured throughput each way; None: the γ policy alone decides
        self.telemetry = telemetry or RequestTelemetry()
        self.stats = RequestStats()
        self.state = GenerationState(plan, self.stats, self.telemetry)
        self.sessions = ReplicaSessions(self.state, draft, verify, call_timeout_s, on_draft_unavailable)
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
                await self.sessions.open()
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

    async def _sync_and_propose(self, round_span: Context) -> DraftBlock:
        """Drafts the next block afresh, on the lane that needs the least syncing to the committed sequence."""
        num_tokens = self.sizing.block_size(0, self.sizing.gamma())
        if self.sessions.draft is None or num_tokens == 0:
            return DraftBlock([], None)
        committed = self.state.committed
        lane = max(self.state.lanes, key=lambda candidate: candidate.sync_to(committed)[0])
        lookup = self.sizing.lookup_size(0, num_tokens)
        [block] = await self.calls.propose([LaneCall(lane, list(committed), num_tokens, lookup)], round_span)
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
            committed.extend([*verdict.accepted_token_ids, verdict.next_token_id])
            if self.gate is not None:
                self.gate.committed(accepted + 1)
            return self.text.add([*verdict.accepted_token_ids, verdict.next_token_id])
