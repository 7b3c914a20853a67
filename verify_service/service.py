"""The verify service's logic as a plain object: target sessions and verification rounds. No grpc here."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.errors import InvalidFieldError
from specdec.kv_session import KVSession
from specdec.model_runtime import LoadedModel
from specdec.sampling import SamplingParams, Verdict
from specdec.session_store import SessionStore
from specdec.verification import VerifyTiming, verify_round
from verify_service.settings import VerifySettings
from verify_service.tensor_parallel import TensorParallelLeader


@dataclass
class TargetSession:
    """A target KV session and the sampling settings its verdicts use."""

    kv: KVSession
    params: SamplingParams

    def __len__(self) -> int:
        return len(self.kv)


class VerifyService:
    """Holds target sessions and answers open / verify / close.

    Under tensor parallelism `ranks` is rank 0's TensorParallelLeader: sessions then run their forwards on
    a MirroredModel, so every rank runs them, and the sampler still runs once, here.
    """

    def __init__(self, settings: VerifySettings, model: LoadedModel, ranks: TensorParallelLeader | None = None):
        self.settings = settings
        self.model = model
        self.ranks = ranks
        self.sessions: SessionStore[TargetSession] = SessionStore(settings.max_sessions, lambda s: s.kv.cached_len)

    def _session_model(self, session_id: str):
        return self.model if self.ranks is None else self.ranks.session_model(session_id)

    def open(self, session_id: str, prompt_ids: Sequence[int], params: SamplingParams) -> int:
        """Opens a session and prefills all prompt tokens but the last; returns the prefill time in ns."""
        self.sessions.reserve(session_id)
        started = time.perf_counter_ns()
        kv = KVSession(self._session_model(session_id), prompt_ids)
        kv.prefill()
        self.sessions.add(session_id, TargetSession(kv, params))
        return time.perf_counter_ns() - started

    def verify(self, session_id: str, base_len: int, draft_tokens: Sequence[int],
               draft_probs: torch.Tensor | None) -> tuple[Verdict, VerifyTiming, int]:
        """Runs one round (sync to base_len, score, judge, commit); returns the verdict, timing and new length."""
        if len(draft_tokens) > self.settings.max_speculative_tokens:
            raise InvalidFieldError("draft_token_ids", f"{len(draft_tokens)} tokens exceed the limit of "
                                    f"{self.settings.max_speculative_tokens}")
        session = self.sessions.get(session_id)
        verdict, timing = verify_round(session.kv, session_id, base_len, draft_tokens, draft_probs, session.params)
        return verdict, timing, len(session)

    def close(self, session_id: str) -> bool:
        closed = self.sessions.close(session_id)
        if closed and self.ranks is not None:
            self.ranks.close_session(session_id)
        return closed
