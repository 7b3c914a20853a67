"""The draft service's logic as a plain object: sessions, sync to base_len, proposals. No grpc here."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from draft_service.drafter import DraftSession, Proposal
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
        self.sessions: SessionStore[DraftSession] = SessionStore(settings.max_sessions, lambda s: s.kv_cache_tokens)
        # What one batched draft position costs (one token per session), for the coordinator's policy.
        self.step_cost = calibrate(model, one_token_rows=True) if model is not None else None

    @property
    def methods(self) -> list[str]:
        return [MODEL, NGRAM] if self.model is not None else [NGRAM]

    def open(self, session_id: str, prompt_ids: Sequence[int], params: SamplingParams, method: str | None) -> int:
        """Opens and prefills a session; returns the prefill time in ns."""
        return only_result(self.open_many([(session_id, prompt_ids, params, method)]))

    def open_many(self, opens: Sequence[tuple[str, Sequence[int], SamplingParams, str | None]]) -> list[int | Exception]:
        """Opens sessions, prefilling the model ones in one pass; per open the prefill time in ns, or its error."""
        results: list[int | Exception | None] = [None] * len(opens)
        prefills = []
        for index, (session_id, prompt_ids, params, method) in enumerate(opens):
            try:
                method = method or self.settings.default_draft_method
                if method not in self.methods:
                    raise InvalidFieldError("draft_method", f"{method!r} is not served here (offered: {self.methods})")
                self.sessions.reserve(session_id)
                if method == MODEL:
                    session: DraftSession = ModelDraftSession(self.model, prompt_ids, params)
                    if (plan := session.session.plan_prefill()) is not None:
                        prefills.append(plan)
                else:
                    session = NgramDraftSession(prompt_ids, self.ngram_settings)
                self.sessions.add(session_id, session)
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
        prefill_ns = time.perf_counter_ns() - started
        return [result if isinstance(result, Exception) else prefill_ns for result in results]

    def propose(self, session_id: str, base_len: int, appended_ids: Sequence[int], num_tokens: int) -> ProposeResult:
        """Syncs the session to base_len + appended_ids (the sync invariant), then drafts num_tokens tokens."""
        return only_result(self.propose_many([(session_id, base_len, appended_ids, num_tokens)]))

    def propose_many(self, proposals: Sequence[tuple[str, int, Sequence[int], int]]) -> list[ProposeResult | Exception]:
        """propose() for several sessions (one call per session); the model sessions draft together, one pass
        per drafted position. Per call its result or the error that failed it alone."""
        results: list[ProposeResult | Exception | None] = [None] * len(proposals)
        model_jobs: list[tuple[int, ModelDraftSession, int]] = []
        started = time.perf_counter_ns()
        for index, (session_id, base_len, appended_ids, num_tokens) in enumerate(proposals):
            try:
                if num_tokens > self.settings.max_speculative_tokens:
                    raise InvalidFieldError("num_speculative_tokens", f"{num_tokens} exceeds this drafter's limit "
                                            f"of {self.settings.max_speculative_tokens}")
                session = self.sessions.get(session_id)
                if len(session) < base_len:
                    raise StaleBaseLenError(session_id, base_len, len(session))
                session.truncate(base_len)
                session.append(appended_ids)
                if isinstance(session, ModelDraftSession) and num_tokens:
                    model_jobs.append((index, session, num_tokens))
                else:
                    proposal = session.propose(num_tokens) if num_tokens else Proposal([], None)
                    results[index] = ProposeResult(proposal, len(session), time.perf_counter_ns() - started)
            except Exception as error:  # noqa: BLE001
                results[index] = error
        drafted = draft_many([(session.session, num_tokens, session.params) for _, session, num_tokens in model_jobs])
        draft_ns = time.perf_counter_ns() - started
        for (index, session, _), outcome in zip(model_jobs, drafted):
            results[index] = outcome if isinstance(outcome, Exception) else ProposeResult(
                Proposal(*outcome), len(session), draft_ns, len(model_jobs))
        return results

    def close(self, session_id: str) -> bool:
        return self.sessions.close(session_id)

