"""Overlapped mode: the next block is drafted under guessed verdicts while the current one is verified.

While Verify(block k) runs, the drafter already drafts block k+1 under several guessed verdicts of block k, one
draft lane each (coordinator/verdict_guesses.py): "all accepted, and the bonus token is the draft's own next token", and
for greedy and coupled requests "rejected at position i, replaced by the draft's r-th next most likely token there"
(by log q + g under the coupled rule, the noise the verifier's argmax(log p + g) shares) (1 + γ ·
`predraft_guesses` of them, the ones this request's verdicts matched most often first, and no more than the
measured pass costs say fit inside the verification). A verdict that matches a guess sends that lane's block
straight to the verifier; otherwise the next block is drafted afresh. Each lane's next call rolls it back through
base_len. In chained mode the pre-drafted blocks go to the verifier as soon as they exist (VerifyNext), and it runs
the one its verdict selects without a round trip through the coordinator.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from opentelemetry.context import Context

from coordinator.block_sizing import BlockSizer
from coordinator.generation_state import GenerationState
from coordinator.replica_sessions import ReplicaSessions
from coordinator.round_blocks import Candidate, ChainedRound, DraftBlock, LaneCall, Predraft
from coordinator.round_calls import RoundCalls
from coordinator.verdict_guesses import Guess, assign_lanes, guesses
from specdec.serving.wire import PLAIN_STEP
from specdec.v1 import verifier_pb2


def _retrieve_error(future: asyncio.Future) -> None:
    """Marks a background call's error as seen (it is handled where the call is awaited, if it is)."""
    if not future.cancelled():
        future.exception()


class Predrafter:
    """Pre-drafts one request's next block while its current one is verified, and picks the one the verdict
    selects; in chained mode hands the verifier the next round ahead of the verdict."""

    def __init__(self, state: GenerationState, sessions: ReplicaSessions, calls: RoundCalls, sizing: BlockSizer):
        self.state = state
        self.sessions = sessions
        self.calls = calls
        self.sizing = sizing
        self._last_lanes = 0  # rows the last pre-draft fed the drafter

    def start(self, block: DraftBlock, round_span: Context) -> Predraft | None:
        """Drafts the next block under guessed verdicts of `block`, one lane each, while it is verified. A plain
        step (no drafted tokens) is pre-drafted under one guess: that the verifier's token is the draft's own.
        When the next round is itself plain (γ 0, or no drafter), there is nothing to draft: it is chained."""
        state, plan = self.state, self.state.plan
        if not plan.overlap:
            return None
        gamma = self.sizing.gamma() if self.sessions.draft is not None else 0
        if gamma == 0:
            return self._chain_plain_step(block, round_span)
        if not self.sizing.predrafts():
            return None
        candidates = guesses(block.token_ids, block.alternatives, plan.ranked_alternatives)
        ranked = state.verdicts.rank(candidates)[: len(state.lanes)]
        verified_tokens = len(block.token_ids) + 1
        max_steps = gamma + 1 + self.sizing.lookup_pass()  # + the bonus guess of "all accepted"
        steps = self.sizing.predraft_steps(max_steps, verified_tokens, self._last_lanes)
        ranked = ranked[: self.sizing.guesses_that_fit(len(ranked), steps, verified_tokens)]
        calls: list[tuple[Guess, LaneCall]] = []
        for guess, lane in assign_lanes(ranked, state.lanes, block.lane):
            bonus = guess.next_token is None  # "all accepted" spends a pass on its bonus guess first
            size = min(self.sizing.block_size(guess.accepted + 1, gamma), steps - bonus)
            if size <= 0:
                continue
            sequence = guess.sequence(state.committed, block.token_ids)
            with_lookup = size + bonus < steps  # lookup tokens cost one more pass: only where it still fits
            calls.append((guess, self.sizing.lane_call(lane, sequence, guess.accepted + 1, size, bonus, with_lookup)))
        self._last_lanes = len(calls)
        if not calls:
            return None
        state.stats.predraft_attempts += 1
        state.stats.predraft_guesses += len(calls)
        state.metrics.predraft_attempts.inc()

        after_base_len = len(state.committed)  # where the block being verified starts

        async def predraft() -> list[Candidate]:
            blocks = await self.calls.propose([call for _, call in calls], round_span, predraft=True)
            candidates = []
            for (guess, _), drafted in zip(calls, blocks):
                verdict = guess.verdict(drafted.token_ids)
                block = drafted.tail() if guess.next_token is None else drafted  # "all accepted" drafted the bonus
                if verdict is not None and block.token_ids:
                    candidates.append(Candidate(*verdict, block))
            if plan.chain_rounds and (candidates or pending.plain_on_miss):
                pending.verify_epoch = self.sessions.verify_epoch
                pending.next_round = self._start_verify_next(
                    after_base_len, candidates, pending.plain_on_miss, round_span
                )
            return candidates

        pending = Predraft([guess for guess, _ in calls], plain_on_miss=not self.sizing.fresh_draft_pays(gamma))
        pending.future = asyncio.ensure_future(predraft())
        return pending

    def _chain_plain_step(self, block: DraftBlock, round_span: Context) -> Predraft | None:
        """Chained mode: hands the verifier the next round now, a plain step (a VerifyNext with no candidates), so
        that it runs in the pass after this round's without a round trip through the coordinator (the verifier
        would otherwise idle for that round trip between passes of plain steps); None when not chaining, or when
        this round may end the request."""
        if not self.state.plan.chain_rounds or self.state.remaining <= len(block.token_ids) + 1:
            return None
        pending = Predraft([], plain_on_miss=True)
        pending.verify_epoch = self.sessions.verify_epoch
        pending.next_round = self._start_verify_next(len(self.state.committed), [], True, round_span)
        pending.future = asyncio.get_running_loop().create_future()
        pending.future.set_result([])  # no pre-drafted candidates
        return pending

    def next_call_hint(self, block: DraftBlock, predraft: Predraft | None) -> verifier_pb2.NextCallHint:
        """The verdicts of this round after which the next round follows at once, told to the verifier so that its
        next pass waits for this session (and only then): any verdict when the request has no drafter or when a
        miss turns plain (Generation._rounds); the guesses of the pre-draft otherwise, advice only, since a verdict
        that matches a guess may still find its pre-drafted block unusable; without a pre-draft, any after a plain
        step in overlapped mode (γ is 0, so the next round is most likely plain too) and none otherwise; none when
        this round ends the request (it emits at least one token)."""
        plan = self.state.plan
        if self.state.remaining <= 1:
            return verifier_pb2.NextCallHint()
        if self.sessions.draft is None or (predraft is not None and (predraft.plain_on_miss or plan.chain_rounds)):
            return verifier_pb2.NextCallHint(after_any_verdict=True)
        if predraft is None:
            return verifier_pb2.NextCallHint(after_any_verdict=plan.overlap and not block.token_ids)
        return verifier_pb2.NextCallHint(
            after_verdicts=[
                verifier_pb2.GuessedVerdict(num_accepted=guess.accepted, next_token_id=guess.next_token)
                for guess in predraft.guesses
            ]
        )

    async def next_round(
        self, predraft: Predraft | None, verdict: verifier_pb2.VerifyResponse
    ) -> tuple[DraftBlock | None, ChainedRound | None]:
        """The next block: the pre-drafted one the verdict selects, or a plain step if the pre-draft says so, or
        None (draft afresh); with the VerifyNext call that has the verifier run it already (chained mode)."""
        if predraft is None:
            return None, None
        candidates = await predraft.future
        verdict_key = (len(verdict.accepted_token_ids), verdict.next_token_id)
        index = next((i for i, c in enumerate(candidates) if (c.num_accepted, c.next_token) == verdict_key), None)
        if index is not None:
            self.state.stats.predraft_hits += 1
            self.state.metrics.predraft_hits.inc()
            block = candidates[index].block
        elif predraft.plain_on_miss:
            index, block = PLAIN_STEP, DraftBlock([], None)
        else:
            return None, None  # the verifier runs none of them either
        if predraft.next_round is None:
            return block, None
        return block, ChainedRound(predraft.next_round, index, predraft.verify_epoch)

    def _start_verify_next(
        self, after_base_len: int, candidates: Sequence[Candidate], plain_otherwise: bool, round_span: Context
    ) -> asyncio.Future:
        """Sends RoundCalls.verify_next in the background; -> VerifyNextResponse. The round it hands over follows
        one that emits at least a token, and emits one itself: with 2 tokens left it surely ends the request."""
        ends_request = self.state.remaining <= 2
        call = asyncio.ensure_future(
            self.calls.verify_next(after_base_len, candidates, plain_otherwise, round_span, ends_request)
        )
        call.add_done_callback(_retrieve_error)  # it may end unawaited (request over)
        return call
