"""How many tokens one request's next block drafts, and how many guesses its pre-draft makes.

With adaptive γ (an AcceptanceRate given), each block's size is chosen within [0, plan.gamma] from the
request's live acceptance rate and the replicas' measured pass costs at their current batch sizes, and a
pre-draft makes only as many guesses as those costs say fit inside the verification
(coordinator/speculation_policy.py); every reply refreshes those measurements. Without it every block drafts
plan.gamma tokens. No block drafts past the request's token budget.
"""

from __future__ import annotations

import time

from coordinator.draft_lanes import DraftLane
from coordinator.generation_state import GenerationState
from coordinator.replica_sessions import ReplicaSessions
from coordinator.round_blocks import LaneCall
from coordinator.speculation_gate import CONTESTED_GAIN, CONTESTED_ROWS, SpeculationGate
from coordinator.speculation_policy import (
    AcceptanceRate,
    PassLoad,
    RoundTimes,
    affordable_guesses,
    choose_gamma,
    fresh_draft_pays,
    log2_level,
    predraft_steps,
    round_ns,
    speculation_gain,
)

PRIOR_PREDRAFTS = 4  # weight of the 1/2 prior in a request's pre-draft hit rate


class BlockSizer:
    """Sizes one request's blocks by the speculation policy, and feeds its rounds back to the policy's measures."""

    def __init__(
        self,
        state: GenerationState,
        sessions: ReplicaSessions,
        acceptance: AcceptanceRate | None = None,
        round_times: RoundTimes | None = None,
        gate: SpeculationGate | None = None,
    ):
        self.state = state
        self.sessions = sessions
        self.acceptance = acceptance  # the coordinator-wide α; None: every block drafts plan.gamma tokens
        self.round_times = round_times  # with acceptance: coordinator-wide realized vs predicted round times
        self.gate = gate  # coordinator-wide measured throughput each way; None: the γ policy alone decides
        self._judged = 0  # drafted tokens the verifier accepted or rejected (those after a rejection are neither)

    def adaptive(self) -> bool:
        """Whether blocks are sized by the policy: adaptive γ, a drafter, and both replicas' costs known."""
        draft = self.sessions.draft
        return (
            self.acceptance is not None
            and draft is not None
            and draft.load is not None
            and self.sessions.verify.load is not None
        )

    def _alpha(self) -> float:
        """The request's acceptance rate as the policy counts it (adaptive γ only)."""
        return self.acceptance.for_request(self._judged, self.state.stats.accepted)

    def _hit_rate(self) -> float | None:
        """The request's pre-draft hit rate, shrunk toward 1/2 while it has few pre-drafts (None if not
        overlapped)."""
        if not self.state.plan.overlap:
            return None
        stats = self.state.stats
        return (stats.predraft_hits + PRIOR_PREDRAFTS / 2) / (stats.predraft_attempts + PRIOR_PREDRAFTS)

    def gamma(self) -> int:
        """The next block's γ: plan.gamma, or with adaptive γ the policy's choice within [0, plan.gamma]."""
        if not self.adaptive():
            return self.state.plan.gamma
        verify, draft = self.sessions.verify, self.sessions.draft
        policy = (self._alpha(), self.state.plan.gamma, verify.load, draft.load, self._hit_rate(), self.round_times)
        gamma = choose_gamma(*policy)

        def contested() -> bool:  # asked by the gate only when it needs the answer
            return verify.load.rows >= CONTESTED_ROWS and speculation_gain(*policy) < CONTESTED_GAIN

        if gamma and self.gate is not None and not self.gate.allows_speculation(contested):
            return 0  # the gate measured plain rounds faster at this load (or is measuring them)
        return gamma

    def block_size(self, tokens_before: int, gamma: int) -> int:
        """The size of a γ block that starts after tokens_before more commits: never draft past the budget."""
        return max(0, min(gamma, self.state.remaining - tokens_before - 1))

    def predrafts(self) -> bool:
        """Whether a block is pre-drafted while the one before it is verified: below the verifier batch the plan
        sets (while its batch is unknown, yes). At batching loads the guesses' rows fill the drafter's passes and
        delay every session's drafts more than their hits save (docs/architecture.md, "Pre-drafting under
        load")."""
        limit, load = self.state.plan.predraft_max_batch, self.sessions.verify.load
        return not limit or load is None or load.rows < limit

    def lookup_pass(self) -> int:
        """Draft passes a block spends on lookup tokens when it takes them: 1 for greedy requests that do, else 0."""
        return int(self.state.plan.lookup_tokens > 0 and self.state.plan.params.greedy)

    def lookup_size(self, tokens_before: int, size: int) -> int:
        """Lookup tokens a block of `size` drafted tokens after tokens_before more commits may try (greedy only):
        the block may grow by that + 1 (the draft's own next token), never past the budget."""
        if not size or not self.state.plan.params.greedy:
            return 0
        return max(0, min(self.state.plan.lookup_tokens, self.state.remaining - tokens_before - size - 2))

    def predraft_steps(self, max_steps: int, verified_tokens: int, own_rows: int) -> int:
        """How many draft passes a pre-draft makes, at most max_steps, while a block of verified_tokens is verified:
        max_steps, or with adaptive γ only as many as end within the verification (coordinator/speculation_policy.py);
        own_rows: the lanes this request's last pre-draft fed, part of the drafter's measured batch."""
        loads = self._predraft_loads()
        if loads is None:
            return max_steps
        verify_load, draft_load = loads
        return predraft_steps(max_steps, verify_load.rows * verified_tokens, verify_load, draft_load, own_rows)

    def lane_call(
        self, lane: DraftLane, sequence: list[int], tokens_before: int, size: int, bonus: bool, with_lookup: bool = True
    ) -> LaneCall:
        """The call drafting a block of `size` tokens on `lane` after tokens_before more commits (first the bonus
        guess when `bonus`): its lookup tokens (greedy, unless not with_lookup), and the tokens its constraint forces
        that it may hold with no pass, as many as the budget and the largest γ leave."""
        lookup = self.lookup_size(tokens_before, size) if with_lookup else 0
        grown = size + (lookup + 1 if lookup else 0)
        room = min(self.state.plan.forced_tokens - grown + size, self.state.remaining - tokens_before - grown - 1)
        return LaneCall(lane, sequence, size + 1 if bonus else size, lookup, max(0, room) if size else 0)

    def guesses_that_fit(self, guesses: int, steps: int, verified_tokens: int) -> int:
        """How many of `guesses` pre-drafts of `steps` draft passes fit inside the verification of a block of
        verified_tokens (all of them without adaptive γ, or while a replica's costs are unknown)."""
        loads = self._predraft_loads()
        if loads is None:
            return guesses
        verify_load, draft_load = loads
        return affordable_guesses(guesses, steps, verify_load.rows * verified_tokens, verify_load, draft_load)

    def _predraft_loads(self) -> tuple[PassLoad, PassLoad] | None:
        """Both replicas' measured costs when the policy sizes pre-drafts: with adaptive γ, once both are known."""
        verify_load, draft_load = self.sessions.verify.load, self.sessions.draft.load
        if self.acceptance is None or verify_load is None or draft_load is None:
            return None
        return verify_load, draft_load

    def fresh_draft_pays(self, gamma: int) -> bool:
        """Whether a verdict that no pre-draft guessed should be followed by a block drafted afresh (else by a
        plain step at once); without adaptive γ it always is."""
        if not self.adaptive():
            return True
        return fresh_draft_pays(
            self._alpha(), gamma, self.sessions.verify.load, self.sessions.draft.load, self.round_times
        )

    def time_round(self, drafted: int, started_ns: int) -> None:
        """Compares the round that just got its verdict (from when its block was awaited) with the model's
        prediction for a block of that size, for the policy's measured slowdowns."""
        if self.round_times is not None and self.adaptive():
            verify_load = self.sessions.verify.load
            predicted = round_ns(drafted, verify_load, self.sessions.draft.load, self._hit_rate())
            rows, speculative = verify_load.rows, drafted > 0
            self.round_times.observe(speculative, rows, time.perf_counter_ns() - started_ns, predicted)
            kind, load = "speculative" if speculative else "plain", str(log2_level(rows))
            self.state.metrics.round_slowdown.labels(kind, load).set(self.round_times.slowdown(speculative, rows))

    def observe_verdict(self, drafted: int, accepted: int) -> None:
        """Counts a round's verdict in the request's and the coordinator-wide acceptance rate (adaptive γ only)."""
        if self.acceptance is not None:
            judged = accepted + (accepted < drafted)  # the draft tokens the verifier ruled on this round
            self._judged += judged
            self.acceptance.observe(judged, accepted)
