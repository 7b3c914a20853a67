"""One request's draft -> verify -> commit rounds across a draft and a verify replica.

Sequential mode: Propose(block k) then Verify(block k). Overlapped mode: while Verify(block k) runs, the
drafter already drafts block k+1 under several guessed verdicts of block k, one draft lane each
(coordinator/predraft.py): "all accepted, and the bonus token is the draft's own next token", and for greedy
requests "rejected at position i, replaced by the draft's r-th next most likely token there" (1 + γ ·
`predraft_guesses` of them, the ones this request's verdicts matched most often first, and no more than the
measured pass costs say fit inside the verification). A verdict that matches a
guess sends that lane's block straight to the verifier; otherwise the next block is drafted afresh. Each lane's
next call rolls it back through base_len. Draws are keyed by (seed, position), so both modes commit the same
tokens.

Each loop iteration is one round: [propose block k,] verify block k (pre-drafting block k+1 meanwhile),
commit. Stats, metrics and spans are fed from the same figures (coordinator/request_telemetry.py).

With adaptive γ (an AcceptanceRate given), each block's size is chosen within [0, plan.gamma] from the
request's live acceptance rate and the replicas' measured pass costs at their current batch sizes, and a
pre-draft makes only as many guesses as those costs say fit inside the verification
(coordinator/speculation_policy.py); every reply refreshes those measurements.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import grpc
from opentelemetry.context import Context

from coordinator.predraft import DraftLane, Guess, VerdictHistory, assign_lanes, guesses
from coordinator.replicas import Replica
from coordinator.request_telemetry import RemoteCall, RequestTelemetry
from coordinator.speculation_gate import CONTESTED_GAIN, CONTESTED_ROWS, SpeculationGate
from coordinator.speculation_policy import (AcceptanceRate, RoundTimes, affordable_guesses, choose_gamma,
                                           fresh_draft_pays, log2_level, round_ns, speculation_gain)
from coordinator.text_stream import Chunk, TextStream
from specdec.errors import DownstreamUnavailableError
from specdec.sampling import SamplingParams
from specdec.speculation_stats import SpeculationStats
from specdec.v1 import common_pb2, drafter_pb2, verifier_pb2
from specdec.wire import PLAIN_STEP, sampling_to_proto

log = logging.getLogger(__name__)
T = TypeVar("T")
FAILED_DRAFTER_CLOSE_TIMEOUT_S = 2.0
PRIOR_PREDRAFTS = 4  # weight of the 1/2 prior in a request's pre-draft hit rate
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

    @property
    def rejection_guesses(self) -> int:
        """Rejection guesses per block position. Greedy only: under sampling the token after a rejection is a
        draw from the residual distribution, which the draft's ranking seldom names (pre-draft hit rate 0.08 at
        temperature 1 on the demo pair, against 0.69 greedy), so those lanes would cost without paying."""
        return self.predraft_guesses if self.overlap and self.params.greedy else 0

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
    round_timeline: list[tuple[str, int, int]] = field(default_factory=list)  # (stage, start_ns, end_ns)


@dataclass
class DraftBlock:
    """Drafted tokens with their q (None = one-hot) as returned by the drafter, per position the draft's next
    most likely other tokens, and the lane that drafted them."""

    token_ids: list[int]
    probs: common_pb2.ProbabilityMatrix | None
    alternatives: list[list[int]] = field(default_factory=list)
    lane: int = 0

    def tail(self) -> DraftBlock:
        """The block without its first token (the bonus guess of an "all accepted" pre-draft)."""
        probs = None
        if self.probs is not None and self.probs.rows:
            row_bytes = self.probs.vocab_size * 4
            probs = common_pb2.ProbabilityMatrix(rows=self.probs.rows - 1, vocab_size=self.probs.vocab_size,
                                                 float32_data=self.probs.float32_data[row_bytes:])
        return DraftBlock(self.token_ids[1:], probs, self.alternatives[1:], self.lane)

    @classmethod
    def from_reply(cls, reply: drafter_pb2.ProposeResponse, lane: int) -> DraftBlock:
        """One lane's reply: alternative_token_ids [drafted, k] row-major become one list per position."""
        probs = reply.draft_probs if reply.HasField("draft_probs") and reply.draft_probs.rows else None
        tokens = list(reply.draft_token_ids)
        width = len(reply.alternative_token_ids) // len(tokens) if tokens else 0
        alternatives = [list(reply.alternative_token_ids[i * width:(i + 1) * width]) for i in range(len(tokens))]
        return cls(tokens, probs, alternatives if width else [], lane)


@dataclass(frozen=True)
class LaneCall:
    """What one lane is asked to hold and draft in a ProposeLanes call."""

    lane: DraftLane
    sequence: list[int]
    num_tokens: int


@dataclass(frozen=True)
class Candidate:
    """A pre-drafted next block and the verdict of the current block it follows."""

    num_accepted: int
    next_token: int
    block: DraftBlock


@dataclass
class ChainedRound:
    """A round the verifier runs by itself once the previous verdict is known (VerifyNext): the call, and which
    of its candidates the verdict selects (PLAIN_STEP: the plain step)."""

    call: asyncio.Future  # -> verifier_pb2.VerifyNextResponse
    index: int


@dataclass
class Predraft:
    """The next block being drafted under guessed verdicts of the current one; what follows a verdict that matches
    none of them: a block drafted afresh, or (plain_on_miss) a plain step at once; and in chained mode the
    VerifyNext call that hands the drafted blocks (and that plain step) to the verifier as soon as they exist."""

    guesses: list[Guess]
    plain_on_miss: bool
    future: asyncio.Future = field(init=False)  # -> [Candidate]: the usable blocks, as VerifyNext lists them
    next_round: asyncio.Future | None = None  # chained mode: -> VerifyNextResponse, set before `future` resolves

    def cancel(self) -> None:
        self.future.cancel()
        if self.next_round is not None:
            self.next_round.cancel()


def _retrieve_error(future: asyncio.Future) -> None:
    """Marks a background call's error as seen (it is handled where the call is awaited, if it is)."""
    if not future.cancelled():
        future.exception()


class Generation:
    """Runs one request on one draft and one verify replica, yielding a Chunk per committed round."""

    def __init__(self, plan: GenerationPlan, draft: Replica | None, verify: Replica, text: TextStream,
                 call_timeout_s: float, telemetry: RequestTelemetry | None = None,
                 on_draft_unavailable: Callable[[Replica], None] | None = None,
                 acceptance: AcceptanceRate | None = None, round_times: RoundTimes | None = None,
                 gate: SpeculationGate | None = None):
        self.plan = plan
        self.acceptance = acceptance  # the coordinator-wide α; None: every block drafts plan.gamma tokens
        self.round_times = round_times  # with acceptance: coordinator-wide realized vs predicted round times
        self.gate = gate  # coordinator-wide measured throughput each way; None: the γ policy alone decides
        self.on_draft_unavailable = on_draft_unavailable  # e.g. take the replica out of placement
        self.draft = draft if plan.gamma > 0 else None
        self._draft_holding_session = self.draft  # still closed at the end if the drafter fails mid-request
        self.verify = verify
        self.text = text
        self.timeout = call_timeout_s
        self.telemetry = telemetry or RequestTelemetry()
        self.metrics = self.telemetry.metrics
        self.stats = RequestStats()
        self.committed: list[int] = list(plan.prompt_ids)
        self.lanes = [DraftLane(index, list(plan.prompt_ids), len(plan.prompt_ids))
                      for index in range(plan.draft_lanes)]
        self.verdicts = VerdictHistory()  # which guesses this request's verdicts matched, to rank the next ones
        self._judged = 0  # drafted tokens the verifier accepted or rejected (those after a rejection are neither)
        self._started_ns = time.perf_counter_ns()

    def elapsed_ns(self) -> int:
        """Time since the request started."""
        return time.perf_counter_ns() - self._started_ns

    @property
    def remaining(self) -> int:
        return self.plan.max_new_tokens - (len(self.committed) - len(self.plan.prompt_ids))

    async def chunks(self) -> AsyncIterator[Chunk]:
        """Opens both sessions, runs rounds until a stop rule fires, and always closes the sessions."""
        plan = self.plan
        with self.telemetry.request(plan.request_id, len(plan.prompt_ids), plan.gamma, plan.overlap):
            if self.gate is not None:
                self.gate.enter()
            try:
                await self._open_sessions()
                async with contextlib.aclosing(self._rounds()) as rounds:  # ends after the chunk with a finish reason
                    async for chunk in rounds:
                        self.telemetry.emitted(len(chunk.token_ids))
                        yield chunk
            finally:
                if self.gate is not None:
                    self.gate.leave()
                self.stats.total_ns = self.elapsed_ns()
                await asyncio.shield(self._close_sessions())
                stats = self.stats
                self.telemetry.finished(self.text.finish_reason or "incomplete", rounds=stats.rounds,
                                        drafted_tokens=stats.drafted, accepted_tokens=stats.accepted,
                                        generated_tokens=len(self.text.token_ids))

    async def _open_sessions(self) -> None:
        started = time.perf_counter_ns()
        sampling = sampling_to_proto(self.plan.params)
        with self.telemetry.stage("open_sessions") as parent:
            calls = [self._open(self.verify, "verify", parent, verifier_pb2.OpenVerifySessionRequest(
                session_id=self.plan.request_id, prompt_token_ids=self.plan.prompt_ids, sampling=sampling))]
            if self.draft is not None:
                calls.append(self._without_draft_on_failure(self._open(
                    self.draft, "draft", parent, drafter_pb2.OpenDraftSessionRequest(
                        session_id=self.plan.request_id, prompt_token_ids=self.plan.prompt_ids, sampling=sampling,
                        draft_method=self.plan.draft_method, num_lanes=len(self.lanes)))))
            await asyncio.gather(*calls)
        self.stats.prefill_ns = time.perf_counter_ns() - started
        self.metrics.stage_ns(prefill=self.stats.prefill_ns)

    async def _without_draft_on_failure(self, call: Awaitable[T]) -> T | None:
        """Runs a drafter call; if the drafter fails (gone, past its deadline, lost the session), the request
        carries on by plain target decoding through the verifier, which is still exact. None on failure."""
        draft = self.draft
        try:
            return await call
        except (DownstreamUnavailableError, grpc.aio.AioRpcError) as error:
            if isinstance(error, grpc.aio.AioRpcError) and error.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise  # the request itself is wrong (e.g. a draft method this drafter does not serve)
            if self.draft is draft and draft is not None:
                log.warning("request %s: drafter %s failed (%s); finishing by plain decoding", self.plan.request_id,
                            draft.address, error)
                self.draft = None
                self.stats.draft_fallbacks += 1
                if isinstance(error, DownstreamUnavailableError) and self.on_draft_unavailable is not None:
                    self.on_draft_unavailable(draft)
            return None

    async def _open(self, replica: Replica, lane: str, parent: Context, request) -> None:
        with self.telemetry.remote_call(f"{lane}.open_session", parent) as call:
            reply = await self._call(replica, "OpenSession", request)
            call.inside(f"{lane}.prefill", lane, reply.prefill_ns)

    async def _close_sessions(self) -> None:
        """Closes the sessions on both replicas, the drafter's too after a fallback (it may be back, or only
        slow): there with a short deadline, since it already failed once."""
        request = common_pb2.CloseSessionRequest(session_id=self.plan.request_id)
        replicas = [(r, lane) for r, lane in ((self.verify, "verify"), (self._draft_holding_session, "draft"))
                    if r is not None]

        async def close(replica: Replica, lane: str, parent: Context) -> None:
            failed_drafter = lane == "draft" and self.draft is None
            with self.telemetry.remote_call(f"{lane}.close_session", parent):
                await replica.stub.CloseSession(request, timeout=min(self.timeout, FAILED_DRAFTER_CLOSE_TIMEOUT_S)
                                                if failed_drafter else self.timeout)

        with self.telemetry.stage("close_sessions") as parent:
            results = await asyncio.gather(*(close(r, lane, parent) for r, lane in replicas), return_exceptions=True)
        for (replica, _), result in zip(replicas, results):
            if isinstance(result, Exception):
                log.warning("request %s: closing its session on %s failed: %s", self.plan.request_id,
                            replica.address, result)

    async def _call(self, replica: Replica, method: str, request):
        """One internal call with a deadline; a replica that is gone becomes DownstreamUnavailableError."""
        try:
            return await getattr(replica.stub, method)(request, timeout=self.timeout)
        except grpc.aio.AioRpcError as error:
            if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise DownstreamUnavailableError(f"{replica.address} {method}: {error.code().name}: "
                                                 f"{error.details()}") from error
            raise

    def _count_call(self, label: str, call: RemoteCall, **stage_ns: int) -> None:
        """Adds one round call's service-side stage times and its wire time to the stats and the metrics."""
        for stage, ns in stage_ns.items():
            setattr(self.stats, f"{stage}_ns", getattr(self.stats, f"{stage}_ns") + ns)
        self.stats.wire_ns += call.wire_ns
        self.stats.round_timeline.append((label, call.started_ns - self._started_ns, call.ended_ns - self._started_ns))
        self.metrics.stage_ns(wire=call.wire_ns, **stage_ns)

    def _adaptive(self) -> bool:
        """Whether blocks are sized by the policy: adaptive γ, a drafter, and both replicas' costs known."""
        return (self.acceptance is not None and self.draft is not None and self.draft.load is not None
                and self.verify.load is not None)

    def _alpha(self) -> float:
        """The request's acceptance rate as the policy counts it (adaptive γ only)."""
        return self.acceptance.for_request(self._judged, self.stats.accepted)

    def _hit_rate(self) -> float | None:
        """The request's pre-draft hit rate, shrunk toward 1/2 while it has few pre-drafts (None if not
        overlapped)."""
        if not self.plan.overlap:
            return None
        return (self.stats.predraft_hits + PRIOR_PREDRAFTS / 2) / (self.stats.predraft_attempts + PRIOR_PREDRAFTS)

    def _gamma(self) -> int:
        """The next block's γ: plan.gamma, or with adaptive γ the policy's choice within [0, plan.gamma]."""
        if not self._adaptive():
            return self.plan.gamma
        policy = (self._alpha(), self.plan.gamma, self.verify.load, self.draft.load, self._hit_rate(), self.round_times)
        gamma = choose_gamma(*policy)

        def contested() -> bool:  # asked by the gate only when it needs the answer
            return self.verify.load.rows >= CONTESTED_ROWS and speculation_gain(*policy) < CONTESTED_GAIN

        if gamma and self.gate is not None and not self.gate.allows_speculation(contested):
            return 0  # the gate measured plain rounds faster at this load (or is measuring them)
        return gamma

    def _time_round(self, drafted: int, started_ns: int) -> None:
        """Compares the round that just got its verdict (from when its block was awaited) with the model's
        prediction for a block of that size, for the policy's measured slowdowns."""
        if self.round_times is not None and self._adaptive():
            predicted = round_ns(drafted, self.verify.load, self.draft.load, self._hit_rate())
            rows, speculative = self.verify.load.rows, drafted > 0
            self.round_times.observe(speculative, rows, time.perf_counter_ns() - started_ns, predicted)
            kind, load = "speculative" if speculative else "plain", str(log2_level(rows))
            self.metrics.round_slowdown.labels(kind, load).set(self.round_times.slowdown(speculative, rows))

    def _block_size(self, tokens_before: int, gamma: int) -> int:
        """The size of a γ block that starts after tokens_before more commits: never draft past the budget."""
        return max(0, min(gamma, self.remaining - tokens_before - 1))

    async def _propose(self, calls: Sequence[LaneCall], round_span: Context, predraft: bool = False
                       ) -> list[DraftBlock]:
        """Syncs and drafts the given lanes in one ProposeLanes call; empty blocks when the drafter has failed
        (the round becomes a plain step)."""
        blocks = await self._without_draft_on_failure(self._propose_on_drafter(calls, round_span, predraft))
        return blocks if blocks is not None else [DraftBlock([], None) for _ in calls]

    async def _propose_on_drafter(self, calls: Sequence[LaneCall], round_span: Context,
                                  predraft: bool) -> list[DraftBlock]:
        draft, committed_len = self.draft, len(self.committed)
        alternatives = self.plan.ranked_alternatives
        proposals = []
        for call in calls:
            base_len, appended = call.lane.sync_to(call.sequence)
            proposals.append(drafter_pb2.LaneProposal(
                lane=call.lane.index, base_len=base_len, appended_token_ids=appended,
                num_speculative_tokens=call.num_tokens, num_alternatives=alternatives))
        steps = max(call.num_tokens for call in calls)
        with self.telemetry.remote_call("draft.propose", round_span, base_len=committed_len, num_tokens=steps,
                                        lanes=len(calls), predraft=predraft) as remote:
            reply = await self._call(draft, "ProposeLanes", drafter_pb2.ProposeLanesRequest(
                session_id=self.plan.request_id, lanes=proposals))
            draft_ns = reply.lanes[0].draft_ns if reply.lanes else 0
            remote.inside("draft.forward", "draft", draft_ns)
        self._count_call("draft", remote, draft=draft_ns)
        rows = reply.lanes[0].batch_rows if reply.lanes else 0
        if draft.load is not None and steps and rows:  # one pass per drafted position
            draft.load.observe(rows, draft_ns / steps, rows)
            draft.load.observe_call(remote.wire_ns)
        blocks = [DraftBlock.from_reply(lane_reply, call.lane.index) for call, lane_reply in zip(calls, reply.lanes)]
        for call, block in zip(calls, blocks):
            call.lane.synced(call.sequence, block.token_ids, committed_len)
        return blocks

    async def _sync_and_propose(self, round_span: Context) -> DraftBlock:
        """Drafts the next block afresh, on the lane that needs the least syncing to the committed sequence."""
        num_tokens = self._block_size(0, self._gamma())
        if self.draft is None or num_tokens == 0:
            return DraftBlock([], None)
        lane = max(self.lanes, key=lambda candidate: candidate.sync_to(self.committed)[0])
        [block] = await self._propose([LaneCall(lane, list(self.committed), num_tokens)], round_span)
        return block

    def _start_predraft(self, block: DraftBlock, round_span: Context) -> Predraft | None:
        """Drafts the next block under guessed verdicts of `block`, one lane each, while it is verified. A plain
        step (no drafted tokens) is pre-drafted under one guess: that the verifier's token is the draft's own.
        When the next round is itself plain (γ 0, or no drafter), there is nothing to draft: it is chained."""
        if not self.plan.overlap:
            return None
        gamma = self._gamma() if self.draft is not None else 0
        if gamma == 0:
            return self._chain_plain_step(block, round_span)
        candidates = guesses(block.token_ids, block.alternatives, self.plan.ranked_alternatives)
        ranked = self.verdicts.rank(candidates)[:len(self.lanes)]
        verify_load, draft_load = self.verify.load, self.draft.load
        if self.acceptance is not None and verify_load is not None and draft_load is not None:  # adaptive
            verify_tokens = verify_load.rows * (len(block.token_ids) + 1)
            ranked = ranked[:affordable_guesses(len(ranked), gamma + 1, verify_tokens, verify_load, draft_load)]
        calls: list[tuple[Guess, LaneCall]] = []
        for guess, lane in assign_lanes(ranked, self.lanes, block.lane):
            size = self._block_size(guess.accepted + 1, gamma)
            if size <= 0:
                continue
            num_tokens = size + 1 if guess.next_token is None else size  # + the drafter's own bonus guess
            calls.append((guess, LaneCall(lane, guess.sequence(self.committed, block.token_ids), num_tokens)))
        if not calls:
            return None
        self.stats.predraft_attempts += 1
        self.stats.predraft_guesses += len(calls)
        self.metrics.predraft_attempts.inc()

        after_base_len = len(self.committed)  # where the block being verified starts

        async def predraft() -> list[Candidate]:
            blocks = await self._propose([call for _, call in calls], round_span, predraft=True)
            candidates = []
            for (guess, _), drafted in zip(calls, blocks):
                verdict = guess.verdict(drafted.token_ids)
                block = drafted.tail() if guess.next_token is None else drafted  # "all accepted" drafted the bonus
                if verdict is not None and block.token_ids:
                    candidates.append(Candidate(*verdict, block))
            if self.plan.chain_rounds and (candidates or pending.plain_on_miss):
                pending.next_round = self._start_verify_next(after_base_len, candidates, pending.plain_on_miss,
                                                             round_span)
            return candidates

        pending = Predraft([guess for guess, _ in calls], plain_on_miss=not self._fresh_draft_pays(gamma))
        pending.future = asyncio.ensure_future(predraft())
        return pending

    def _chain_plain_step(self, block: DraftBlock, round_span: Context) -> Predraft | None:
        """Chained mode: hands the verifier the next round now, a plain step (a VerifyNext with no candidates), so
        that it runs in the pass after this round's without a round trip through the coordinator (the verifier
        would otherwise idle for that round trip between passes of plain steps); None when not chaining, or when
        this round may end the request."""
        if not self.plan.chain_rounds or self.remaining <= len(block.token_ids) + 1:
            return None
        pending = Predraft([], plain_on_miss=True)
        pending.next_round = self._start_verify_next(len(self.committed), [], True, round_span)
        pending.future = asyncio.get_running_loop().create_future()
        pending.future.set_result([])  # no pre-drafted candidates
        return pending

    def _fresh_draft_pays(self, gamma: int) -> bool:
        """Whether a verdict that no pre-draft guessed should be followed by a block drafted afresh (else by a
        plain step at once); without adaptive γ it always is."""
        if not self._adaptive():
            return True
        return fresh_draft_pays(self._alpha(), gamma, self.verify.load, self.draft.load, self.round_times)

    def _next_call_hint(self, block: DraftBlock, predraft: Predraft | None) -> verifier_pb2.NextCallHint:
        """The verdicts of this round after which the next round follows at once, told to the verifier so that its
        next pass waits for this session (and only then): any verdict when the request has no drafter or when a
        miss turns plain (_rounds); the guesses of the pre-draft otherwise, advice only, since a verdict that
        matches a guess may still find its pre-drafted block unusable; without a pre-draft, any after a plain step
        in overlapped mode (γ is 0, so the next round is most likely plain too) and none otherwise."""
        if self.draft is None or (predraft is not None and (predraft.plain_on_miss or self.plan.chain_rounds)):
            return verifier_pb2.NextCallHint(after_any_verdict=True)
        if predraft is None:
            return verifier_pb2.NextCallHint(after_any_verdict=self.plan.overlap and not block.token_ids)
        return verifier_pb2.NextCallHint(after_verdicts=[
            verifier_pb2.GuessedVerdict(num_accepted=guess.accepted, next_token_id=guess.next_token)
            for guess in predraft.guesses])

    async def _next_round(self, predraft: Predraft | None, verdict: verifier_pb2.VerifyResponse
                          ) -> tuple[DraftBlock | None, ChainedRound | None]:
        """The next block: the pre-drafted one the verdict selects, or a plain step if the pre-draft says so, or
        None (draft afresh); with the VerifyNext call that has the verifier run it already (chained mode)."""
        if predraft is None:
            return None, None
        candidates = await predraft.future
        verdict_key = (len(verdict.accepted_token_ids), verdict.next_token_id)
        index = next((i for i, c in enumerate(candidates) if (c.num_accepted, c.next_token) == verdict_key), None)
        if index is not None:
            self.stats.predraft_hits += 1
            self.metrics.predraft_hits.inc()
            block = candidates[index].block
        elif predraft.plain_on_miss:
            index, block = PLAIN_STEP, DraftBlock([], None)
        else:
            return None, None  # the verifier runs none of them either
        return block, ChainedRound(predraft.next_round, index) if predraft.next_round is not None else None

    def _start_verify_next(self, after_base_len: int, candidates: Sequence[Candidate], plain_otherwise: bool,
                           round_span: Context) -> asyncio.Future:
        """Sends _verify_next in the background; -> VerifyNextResponse."""
        call = asyncio.ensure_future(self._verify_next(after_base_len, candidates, plain_otherwise, round_span))
        call.add_done_callback(_retrieve_error)  # it may end unawaited (request over)
        return call

    async def _verify_next(self, after_base_len: int, candidates: Sequence[Candidate], plain_otherwise: bool,
                           round_span: Context) -> verifier_pb2.VerifyNextResponse:
        """Hands the verifier the candidate next rounds: it runs the one its pending verdict selects. The call's
        span sits in the round it was sent in; the round it runs records its verdict (`verify`, chained)."""
        with self.telemetry.remote_call("verify_next", round_span, after_base_len=after_base_len,
                                        candidates=len(candidates), plain_otherwise=plain_otherwise):
            return await self._call(self.verify, "VerifyNext", verifier_pb2.VerifyNextRequest(
                session_id=self.plan.request_id, after_base_len=after_base_len, rounds=[
                    verifier_pb2.GuessedRound(
                        verdict=verifier_pb2.GuessedVerdict(num_accepted=c.num_accepted, next_token_id=c.next_token),
                        draft_token_ids=c.block.token_ids, draft_probs=c.block.probs) for c in candidates],
                plain_otherwise=plain_otherwise, next_call=verifier_pb2.NextCallHint(after_any_verdict=True)))

    async def _chained_verdict(self, chained: ChainedRound) -> verifier_pb2.VerifyResponse | None:
        """The verdict of the round the verifier ran by itself, or None if it ran another one or none (then the
        round is sent as a plain Verify, whose base_len rolls back whatever ran)."""
        answer = await chained.call
        if answer.ran and answer.round_index == chained.index:
            self.stats.chained_rounds += 1
            self.metrics.chained_rounds.inc()
            return answer.verdict
        log.warning("request %s: the verifier ran round %s of a VerifyNext where %d was expected; verifying again",
                    self.plan.request_id, answer.round_index if answer.ran else "none", chained.index)
        return None

    async def _verify(self, block: DraftBlock, round_span: Context, next_call: verifier_pb2.NextCallHint,
                      chained: ChainedRound | None = None) -> verifier_pb2.VerifyResponse:
        """Verifies `block` (already running on the verifier when chained) and records the call."""
        with self.telemetry.remote_call("verify", round_span, base_len=len(self.committed),
                                        num_tokens=len(block.token_ids)) as call:
            reply = await self._chained_verdict(chained) if chained is not None else None
            call.span.set_attribute("specdec.chained", reply is not None)
            if reply is None:
                reply = await self._call(self.verify, "Verify", verifier_pb2.VerifyRequest(
                    session_id=self.plan.request_id, base_len=len(self.committed), draft_token_ids=block.token_ids,
                    draft_probs=block.probs, next_call=next_call))
            call.inside("verify.forward", "verify", reply.forward_ns)
            call.inside("verify.sampling", "verify", reply.sampling_ns)
        self._count_call("verify", call, verify=reply.forward_ns, sampling=reply.sampling_ns)
        if self.verify.load is not None:
            self.verify.load.observe(reply.batch_tokens, reply.forward_ns, reply.batch_rows)
            self.verify.load.observe_call(call.wire_ns)
        return reply

    def _commit(self, block: DraftBlock, verdict: verifier_pb2.VerifyResponse, round_span: Context) -> Chunk:
        """Appends the accepted tokens and the recovered/bonus token; the rejected rest is rolled back
        (the verifier already truncated; each draft lane truncates on its next call's base_len)."""
        drafted, accepted = len(block.token_ids), len(verdict.accepted_token_ids)
        base_len = len(self.committed)
        with self.telemetry.stage("commit", round_span, base_len=base_len, drafted=drafted, accepted=accepted,
                                  rolled_back=drafted - accepted):
            self.stats.record(drafted, accepted)
            self.verdicts.observe(drafted, block.alternatives, accepted, verdict.next_token_id)
            self.metrics.round_committed(drafted, accepted)
            if self.acceptance is not None:
                judged = accepted + (accepted < drafted)  # the draft tokens the verifier ruled on this round
                self._judged += judged
                self.acceptance.observe(judged, accepted)
            self.committed.extend([*verdict.accepted_token_ids, verdict.next_token_id])
            if self.gate is not None:
                self.gate.committed(accepted + 1)
            return self.text.add([*verdict.accepted_token_ids, verdict.next_token_id])

    async def _rounds(self) -> AsyncIterator[Chunk]:
        block: DraftBlock | None = None
        chained: ChainedRound | None = None  # the verifier already runs `block` (chained mode)
        waiting_since = time.perf_counter_ns()  # a round's time runs from the previous verdict to its own
        while True:
            with self.telemetry.round() as round_span:
                if block is None:
                    block = await self._sync_and_propose(round_span)
                predraft = self._start_predraft(block, round_span)
                next_call = self._next_call_hint(block, predraft)
                try:
                    verdict = await self._verify(block, round_span, next_call, chained)
                except BaseException:
                    if predraft is not None:
                        predraft.cancel()
                    raise
                self._time_round(len(block.token_ids), waiting_since)
                chunk = self._commit(block, verdict, round_span)
                finished = bool(chunk.finish_reason) or self.remaining <= 0
                if finished and predraft is not None:
                    # Not needed: cancelled before the last chunk (and its stats) go out, so neither counts it.
                    predraft.cancel()
                    await asyncio.gather(predraft.future, *[predraft.next_round] if predraft.next_round else [],
                                         return_exceptions=True)
                yield chunk
                if finished:
                    return
                waiting_since = time.perf_counter_ns()
                block, chained = await self._next_round(predraft, verdict)
