"""The draft service's logic as a plain object: sessions, sync to base_len, proposals. No grpc here."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from draft_service.drafter import DraftSession, Proposal
from draft_service.lanes import DraftLanes
from draft_service.model_drafter import ModelDraftSession
from draft_service.ngram_drafter import NgramDraftSession, NgramSettings
from draft_service.settings import DraftSettings
from specdec.common.errors import InvalidFieldError, KVCacheFullError, StaleBaseLenError
from specdec.decoding.drafting import Drafted, DraftRun
from specdec.engine.kv.session import run_forwards
from specdec.engine.model_runtime import LoadedModel
from specdec.engine.step_batcher import JoiningStep, only_result, run_joining
from specdec.engine.step_cost import calibrate
from specdec.sampling.constraints import ConstraintCompiler, ConstraintSpec
from specdec.sampling.rules import SamplingParams
from specdec.sampling.sequence_rules import session_rules
from specdec.serving.session_store import SessionStore

MODEL, NGRAM = "model", "ngram"


@dataclass(frozen=True)
class LaneProposal:
    """Sync one lane to base_len + appended_ids, then draft num_tokens tokens (and num_alternatives guesses of
    the verifier's token per drafted position; greedy, then up to num_lookup_tokens lookup tokens the draft
    agrees with and its own next one: specdec/sampling/prompt_lookup.py; and up to num_forced_tokens tokens its
    constraint forces, with no pass)."""

    lane: int
    base_len: int
    appended_ids: Sequence[int]
    num_tokens: int
    num_alternatives: int = 0
    num_lookup_tokens: int = 0
    num_forced_tokens: int = 0
    committed_len: int = 0  # tokens of the lane's synced sequence the verifier has committed (0: not said)


@dataclass(frozen=True)
class ProposeResult:
    """A proposal plus the session's length after it and the time it took."""

    proposal: Proposal
    session_len: int
    draft_ns: int
    batch_rows: int = 1  # lanes per pass that drafted it (the mean over its passes)


@dataclass
class _ProposeCall:
    """A propose call of a running step: its lanes' answers so far and what its passes held."""

    results: list[ProposeResult | None]  # per lane; None while that lane drafts
    started_ns: int
    drafting: int = 0  # lanes still drafting
    passes: int = 0
    rows: int = 0  # lanes fed, summed over its passes

    def answer(self, slot: int, lane: DraftSession, drafted: Proposal) -> None:
        """Lane `slot` has drafted."""
        self.results[slot] = ProposeResult(drafted, len(lane), 0)
        self.drafting -= 1

    def answers(self) -> list[ProposeResult]:
        """Every lane's answer; drafted ones carry the call's drafting time and its mean lanes per pass."""
        if not self.passes:
            return self.results
        draft_ns, rows = time.perf_counter_ns() - self.started_ns, round(self.rows / self.passes)
        return [replace(result, draft_ns=draft_ns, batch_rows=rows) for result in self.results]


class DraftService:
    """Holds draft sessions (model or n-gram) and answers open / propose / close."""

    def __init__(self, settings: DraftSettings, model: LoadedModel | None, vocab_size: int):
        if settings.default_draft_method not in (MODEL, NGRAM):
            raise ValueError(f"default_draft_method must be 'model' or 'ngram', got {settings.default_draft_method!r}")
        if model is None and settings.default_draft_method == MODEL:
            raise ValueError("default_draft_method is 'model' but no draft model is configured")
        self.settings = settings
        self.model = model
        self.vocab_size = vocab_size
        self.ngram_settings = NgramSettings(settings.ngram_min, settings.ngram_max, settings.ngram_max_proposal)
        self.ngram_settings.validate()
        self.sessions: SessionStore[DraftLanes] = SessionStore(
            settings.max_sessions, lambda s: s.kv_cache_tokens, DraftLanes.release
        )
        # What one batched draft position costs (one token per session), for the coordinator's policy.
        self.step_cost = calibrate(model, one_token_rows=True) if model is not None else None
        # Constraints need the tokenizer: a model-free drafter without one proposes without them.
        self.constraints = (
            ConstraintCompiler(model.tokenizer, vocab_size, model.eos_token_ids, settings.constraint_limits())
            if model is not None
            else None
        )

    @property
    def max_tokens_per_lane(self) -> int:
        """Most tokens one lane may draft: a block of max_speculative_tokens plus one, the guess of the verifier's
        bonus token that a coordinator's "all accepted" pre-draft lane drafts ahead of its block
        (coordinator/predrafter.py), so that a request at the largest γ can pre-draft."""
        return self.settings.max_speculative_tokens + 1

    @property
    def methods(self) -> list[str]:
        return [MODEL, NGRAM] if self.model is not None else [NGRAM]

    def open(
        self,
        session_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        method: str | None,
        num_lanes: int = 1,
        constraint: ConstraintSpec | None = None,
        output_start: int = 0,
    ) -> int:
        """Opens and prefills a session (every lane); returns the prefill time in ns. The constraint and the penalties
        cover the tokens from output_start (0: the prompt's end)."""
        opened = (session_id, prompt_ids, params, method, num_lanes, constraint, output_start)
        return only_result(self.open_many([opened]))

    def open_many(self, opens: Sequence[tuple]) -> list[int | Exception]:
        """Opens sessions (session_id, prompt_ids, params, method, num_lanes[, constraint, output_start]), prefilling
        the model ones in one pass, then copying lane 0 into the other lanes; per open the prefill time in ns, or its
        error."""
        results: list[int | Exception | None] = [None] * len(opens)
        prefills = []
        forks: list[tuple[DraftLanes, int]] = []  # lanes still to add by copying lane 0 once it is prefilled
        for index, (session_id, prompt_ids, params, method, num_lanes, *output) in enumerate(opens):
            try:
                rules = session_rules(self.constraints, params, len(prompt_ids), *output)
                method = method or self.settings.default_draft_method
                if method not in self.methods:
                    raise InvalidFieldError("draft_method", f"{method!r} is not served here (offered: {self.methods})")
                if not 1 <= num_lanes <= self.settings.max_lanes:
                    raise InvalidFieldError("num_lanes", f"{num_lanes} is out of range 1..{self.settings.max_lanes}")
                self.sessions.reserve(session_id)
                if method == MODEL:
                    first: DraftSession = ModelDraftSession(self.model, prompt_ids, params, rules)
                    if (plan := first.session.plan_prefill()) is not None:
                        prefills.append(plan)
                else:
                    first = NgramDraftSession(prompt_ids, self.ngram_settings, rules)
                lanes = DraftLanes([first])
                self.sessions.add(session_id, lanes)
                forks.append((lanes, num_lanes - 1))
                results[index] = 0
            except Exception as error:  # noqa: BLE001 - that open fails alone
                results[index] = error
        started = time.perf_counter_ns()
        try:
            run_forwards(prefills)
        except Exception:
            for (session_id, *_), result in zip(opens, results):
                if not isinstance(result, Exception):
                    self.sessions.close(session_id)
            raise
        for lanes, count in forks:
            lanes.add_forks(count)
        prefill_ns = time.perf_counter_ns() - started
        return [result if isinstance(result, Exception) else prefill_ns for result in results]

    def propose(
        self, session_id: str, base_len: int, appended_ids: Sequence[int], num_tokens: int, num_alternatives: int = 0
    ) -> ProposeResult:
        """Syncs lane 0 of the session to base_len + appended_ids (the sync invariant), then drafts num_tokens
        tokens."""
        proposal = LaneProposal(0, base_len, appended_ids, num_tokens, num_alternatives, committed_len=base_len)
        return only_result(self.propose_many([(session_id, [proposal])]))[0]

    def propose_many(
        self, calls: Sequence[tuple[str, Sequence[LaneProposal]]]
    ) -> list[list[ProposeResult] | Exception]:
        """Proposals on the lanes of several sessions (one call per session, one entry per lane); all model lanes
        draft together, one pass per drafted position. Per call one result per lane, or the error that failed
        that call alone."""
        return run_joining(self.propose_joining, calls)

    def propose_joining(self, step: JoiningStep) -> None:
        """Runs the propose calls of a step (each (session_id, [LaneProposal])) in one DraftRun, taking in the calls
        queued since before every pass and answering each call as soon as its lanes have drafted: per call one
        result per lane, or the error that failed that call alone."""
        run = DraftRun()
        running: dict[int, _ProposeCall] = {}  # calls with lanes drafting, by index in the step

        def start(index: int) -> None:
            session_id, proposals = step.calls[index]
            call = _ProposeCall([], time.perf_counter_ns())
            try:
                call.results, jobs = self._sync_lanes(session_id, proposals, call.started_ns)
            except Exception as error:  # noqa: BLE001
                step.finish(index, error)
                return
            if not jobs:  # nothing to draft by model: every lane is answered already
                step.finish(index, call.answers())
                return
            running[index] = call
            call.drafting = len(jobs)
            for slot, lane, proposal in jobs:
                outcome = run.add(
                    (index, slot, lane),
                    lane.session,
                    proposal.num_tokens,
                    lane.params,
                    proposal.num_alternatives,
                    proposal.num_lookup_tokens,
                    lane.rules,
                    proposal.num_forced_tokens,
                )
                if outcome is not None:
                    drafted(index, slot, lane, outcome)

        def drafted(index: int, slot: int, lane: ModelDraftSession, outcome: Drafted | Exception) -> None:
            """Records one lane's outcome; answers the call once its last lane is in, or at its first error."""
            call = running.get(index)
            if call is None:  # an earlier lane of the call failed it
                return
            if isinstance(outcome, Exception):
                del running[index]
                if isinstance(outcome, KVCacheFullError):  # a session that cannot grow is ended (its caller is told)
                    ended.append(step.calls[index][0])
                step.finish(index, outcome)
                return
            # q rows leave the device here, on the model thread, where the step's read has waited for them: the
            # reply is encoded on the event loop, whose own copy would wait behind the next queued pass
            probs = outcome.probs.cpu() if outcome.probs is not None else None  # [γ, V]
            call.answer(slot, lane, Proposal(outcome.token_ids, probs, outcome.alternatives))
            if not call.drafting:
                step.finish(index, running.pop(index).answers())

        ended: list[str] = []  # sessions that could not grow: closed once the step's passes are done with them
        try:
            for index in range(len(step.calls)):
                start(index)
            while run:
                for index in step.join():
                    start(index)
                for call in running.values() if run.runs_a_pass else ():
                    call.passes += 1
                    call.rows += run.rows
                for (index, slot, lane), outcome in run.step():
                    drafted(index, slot, lane, outcome)
        finally:
            for session_id in ended:
                self.close(session_id)

    def _sync_lanes(
        self, session_id: str, proposals: Sequence[LaneProposal], started: int
    ) -> tuple[list[ProposeResult | None], list[tuple[int, ModelDraftSession, LaneProposal]]]:
        """Syncs each named lane. Returns the answers of the lanes answered here (None in the slots of model lanes
        with tokens to draft) and those model lanes as (slot, lane, proposal), to draft in the batch."""
        lanes = self.sessions.get(session_id)
        if len({p.lane for p in proposals}) < len(proposals):
            raise InvalidFieldError("lanes", "names a lane more than once")
        for proposal in proposals:
            self._check(session_id, lanes, proposal)
        # Lanes first take the caches of the lanes that hold more of their new sequences, while none is rolled back.
        caught_up = [bool(p.num_tokens) and lanes.catch_up(p.lane, p.base_len, p.appended_ids) for p in proposals]
        answered: list[ProposeResult | None] = []
        jobs: list[tuple[int, ModelDraftSession, LaneProposal]] = []
        for slot, (proposal, synced) in enumerate(zip(proposals, caught_up)):
            lane = lanes.lane(proposal.lane)
            if not synced:
                lane.truncate(proposal.base_len)
                lane.append(proposal.appended_ids)
            if isinstance(lane, ModelDraftSession) and proposal.num_tokens:
                jobs.append((slot, lane, proposal))
                answered.append(None)
                continue
            drafted = lane.propose(proposal.num_tokens) if proposal.num_tokens else Proposal([], None)
            answered.append(ProposeResult(drafted, len(lane), time.perf_counter_ns() - started))
        # Every synced lane begins with the committed tokens, and the lanes share one record of spelled tokens: one
        # lane judges them for all.
        first = lanes.lane(proposals[0].lane) if proposals else None
        if isinstance(first, ModelDraftSession) and proposals[0].committed_len:
            first.observe_committed(min(proposals[0].committed_len, len(first)))
        return answered, jobs

    def _check(self, session_id: str, lanes: DraftLanes, proposal: LaneProposal) -> None:
        """Refuses a lane proposal over this drafter's limits, or on a lane that is not there or holds too little."""
        if proposal.num_tokens > self.max_tokens_per_lane:
            raise InvalidFieldError(
                "num_speculative_tokens",
                f"{proposal.num_tokens} exceeds this drafter's limit of {self.max_tokens_per_lane} "
                f"(max_speculative_tokens {self.settings.max_speculative_tokens} + the bonus-token guess)",
            )
        if proposal.num_lookup_tokens > self.settings.max_lookup_tokens:
            raise InvalidFieldError(
                "num_lookup_tokens",
                f"{proposal.num_lookup_tokens} exceeds this drafter's limit of {self.settings.max_lookup_tokens}",
            )
        if proposal.num_forced_tokens > self.settings.max_speculative_tokens:
            raise InvalidFieldError(
                "num_forced_tokens",
                f"{proposal.num_forced_tokens} exceeds this drafter's limit of {self.settings.max_speculative_tokens} "
                "(max_speculative_tokens)",
            )
        if proposal.num_alternatives > self.settings.max_alternatives:
            raise InvalidFieldError(
                "num_alternatives",
                f"{proposal.num_alternatives} exceeds this drafter's limit of {self.settings.max_alternatives}",
            )
        lane = lanes.lane(proposal.lane)
        if len(lane) < proposal.base_len:
            raise StaleBaseLenError(session_id, proposal.base_len, len(lane))

    def close(self, session_id: str) -> bool:
        return self.sessions.close(session_id)
