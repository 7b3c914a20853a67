"""The draft service's logic as a plain object: sessions, sync to base_len, proposals. No grpc here."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from draft_service.drafter import DraftSession, Proposal
from draft_service.model_drafter import ModelDraftSession
from draft_service.ngram_drafter import NgramDraftSession, NgramSettings
from draft_service.settings import DraftSettings
from specdec.errors import InvalidFieldError, StaleBaseLenError
from specdec.model_runtime import LoadedModel
from specdec.sampling import SamplingParams
from specdec.session_store import SessionStore

MODEL, NGRAM = "model", "ngram"


@dataclass(frozen=True)
class ProposeResult:
    """A proposal plus the session's length after it and the time it took."""

    proposal: Proposal
    session_len: int
    draft_ns: int


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

    @property
    def methods(self) -> list[str]:
        return [MODEL, NGRAM] if self.model is not None else [NGRAM]

    def open(self, session_id: str, prompt_ids: Sequence[int], params: SamplingParams, method: str | None) -> int:
        """Opens and prefills a session; returns the prefill time in ns."""
        method = method or self.settings.default_draft_method
        if method not in self.methods:
            raise InvalidFieldError("draft_method", f"{method!r} is not served here (offered: {self.methods})")
        self.sessions.reserve(session_id)
        started = time.perf_counter_ns()
        if method == MODEL:
            session: DraftSession = ModelDraftSession(self.model, prompt_ids, params)
        else:
            session = NgramDraftSession(prompt_ids, self.ngram_settings)
        self.sessions.add(session_id, session)
        return time.perf_counter_ns() - started

    def propose(self, session_id: str, base_len: int, appended_ids: Sequence[int], num_tokens: int) -> ProposeResult:
        """Syncs the session to base_len + appended_ids (the sync invariant), then drafts num_tokens tokens."""
        if num_tokens > self.settings.max_speculative_tokens:
            raise InvalidFieldError("num_speculative_tokens",
                                    f"{num_tokens} exceeds this drafter's limit of {self.settings.max_speculative_tokens}")
        session = self.sessions.get(session_id)
        if len(session) < base_len:
            raise StaleBaseLenError(session_id, base_len, len(session))
        started = time.perf_counter_ns()
        session.truncate(base_len)
        session.append(appended_ids)
        proposal = session.propose(num_tokens) if num_tokens else Proposal([], None)
        return ProposeResult(proposal, len(session), time.perf_counter_ns() - started)

    def close(self, session_id: str) -> bool:
        return self.sessions.close(session_id)
