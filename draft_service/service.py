"""The draft service's logic as a plain object: sessions, sync to base_len, proposals. No grpc here."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from draft_service.drafter import DraftSession, Proposal
from draft_service.lanes import DraftLanes
from draft_service.model_drafter import ModelDraftSession
from draft_service.ngram_drafter import NgramDraftSession, NgramSettings
from draft_service.settings import DraftSettings
from specdec.drafting import draft_many
from specdec.errors import InvalidFieldError, StaleBaseLenError
from specdec.kv_session import run_forwards
from specdec.model_runtime import LoadedModel
from specdec.sampling import SamplingParams
from specdec.session_store import SessionStore
from specdec.step_batcher import only_result
from specdec.step_cost import calibrate

MODEL, NGRAM = "model", "ngram"


@dataclass(frozen=True)
class LaneProposal:
    """Sync one lane to base_len + appended_ids, then draft num_tokens tokens (and num_alternatives guesses of
    the verifier's token per drafted position)."""

    lane: int
    base_len: int
    appended_ids: Sequence[int]
    num_tokens: int
    num_alternatives: int = 0


@dataclass(frozen=True)
class ProposeResult:
    """A proposal plus the session's length after it and the time it took."""

    proposal: Proposal
    session_len: int
    draft_ns: int
    batch_rows: int = 1  # proposals drafted by the same passes


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
        self.sessions: SessionStore[DraftLanes] = SessionStore(settings.max_sessions, lambda s: s.kv_cache_tokens)
        # What one batched draft position costs (one token per session), for the coordinator's policy.
        self.step_cost = calibrate(model, one_token_rows=True) if model is not None else None

    @property
    def methods(self) -> list[str]:
        return [MODEL, NGRAM] if self.model is not None else [NGRAM]

    def open(self, session_id: str, prompt_ids: Sequence[int], params: SamplingParams, method: str | None,
             num_lanes: int = 1) -> int:
        """Opens and prefills a session (every lane); returns the prefill time in ns."""
        return only_result(self.open_many([(session_id, prompt_ids, params, method, num_lanes)]))

    def open_many(self, opens: Sequence[tuple[str, Sequence[int], SamplingParams, str | None, int]]
                  ) -> list[int | Exception]:
        """Opens sessions, prefilling the model ones in one pass, then copying lane 0 into the other lanes; per open
        the prefill time in ns, or its error."""
        results: list[int | Exception | None] = [None] * len(opens)
        prefills = []
        forks: list[tuple[DraftLanes, int]] = []  # lanes still to add by copying lane 0 once it is prefilled
        for index, (session_id, prompt_ids, params, method, num_lanes) in enumerate(opens):
            try:
                method = method or self.settings.default_draft_method
                if method not in self.methods:
                    raise InvalidFieldError("draft_method", f"{method!r} is not served here (offered: {self.methods})")
                if not 1 <= num_lanes <= self.settings.max_lanes:
                    raise InvalidFieldError("num_lanes", f"{num_lanes} is out of range 1..{self.settings.max_lanes}")
                self.sessions.reserve(session_id)
                if method == MODEL:
                    first: DraftSession = ModelDraftSession(self.model, prompt_ids, params)
                    if (plan := first.session.plan_prefill()) is not None:
                        prefills.append(plan)
                else:
                    first = NgramDraftSession(prompt_ids, self.ngram_settings)
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

    def propose(self, session_id: str, base_len: int, appended_ids: Sequence[int], num_tokens: int,
                num_alternatives: int = 0) -> ProposeResult:
        """Syncs lane 0 of the session to base_len + appended_ids (the sync invariant), then drafts num_tokens
        tokens."""
        proposal = LaneProposal(0, base_len, appended_ids, num_tokens, num_alternatives)
        return only_result(self.propose_many([(session_id, [proposal])]))[0]

    def propose_many(self, calls: Sequence[tuple[str, Sequence[LaneProposal]]]
                     ) -> list[list[ProposeResult] | Exception]:
        """Proposals on the lanes of several sessions (one call per session, one entry per lane); all model lanes
        draft together, one pass per drafted position. Per call one result per lane, or the error that failed
        that call alone."""
        results: list[list[ProposeResult] | Exception] = [[] for _ in calls]
        model_jobs: list[tuple[int, int, ModelDraftSession, LaneProposal]] = []  # (call, slot, lane, proposal)
        started = time.perf_counter_ns()
        for index, (session_id, proposals) in enumerate(calls):
            try:
                results[index], jobs = self._sync_lanes(session_id, proposals, started)
            except Exception as error:  # noqa: BLE001
                results[index] = error
                continue
            model_jobs.extend((index, slot, lane, proposal) for slot, lane, proposal in jobs)
        drafted = draft_many([(lane.session, p.num_tokens, lane.params, p.num_alternatives)
                              for _, _, lane, p in model_jobs])
        draft_ns = time.perf_counter_ns() - started
        for (index, slot, lane, _), outcome in zip(model_jobs, drafted):
            if isinstance(results[index], Exception):
                continue
            if isinstance(outcome, Exception):
                results[index] = outcome
                continue
            proposal = Proposal(outcome.token_ids, outcome.probs, outcome.alternatives)
            results[index][slot] = ProposeResult(proposal, len(lane), draft_ns, len(model_jobs))
        return results

    def _sync_lanes(self, session_id: str, proposals: Sequence[LaneProposal], started: int
                    ) -> tuple[list[ProposeResult | None], list[tuple[int, ModelDraftSession, LaneProposal]]]:
        """Syncs each named lane. Returns the answers of the lanes answered here (None in the slots of model lanes
        with tokens to draft) and those model lanes as (slot, lane, proposal), to draft in the batch."""
        lanes = self.sessions.get(session_id)
        if len({p.lane for p in proposals}) < len(proposals):
            raise InvalidFieldError("lanes", "names a lane more than once")
        answered: list[ProposeResult | None] = []
        jobs: list[tuple[int, ModelDraftSession, LaneProposal]] = []
        for slot, proposal in enumerate(proposals):
            if proposal.num_tokens > self.settings.max_speculative_tokens:
                raise InvalidFieldError("num_speculative_tokens", f"{proposal.num_tokens} exceeds this drafter's "
                                        f"limit of {self.settings.max_speculative_tokens}")
            if proposal.num_alternatives > self.settings.max_alternatives:
                raise InvalidFieldError("num_alternatives", f"{proposal.num_alternatives} exceeds this drafter's "
                                        f"limit of {self.settings.max_alternatives}")
            lane = lanes.lane(proposal.lane)
            if len(lane) < proposal.base_len:
                raise StaleBaseLenError(session_id, proposal.base_len, len(lane))
            lane.truncate(proposal.base_len)
            lane.append(proposal.appended_ids)
            if isinstance(lane, ModelDraftSession) and proposal.num_tokens:
                jobs.append((slot, lane, proposal))
                answered.append(None)
                continue
            drafted = lane.propose(proposal.num_tokens) if proposal.num_tokens else Proposal([], None)
            answered.append(ProposeResult(drafted, len(lane), time.perf_counter_ns() - started))
        return answered, jobs

    def close(self, session_id: str) -> bool:
        return self.sessions.close(session_id)

