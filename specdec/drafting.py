"""Drafting γ tokens autoregressively from draft-model sessions, many sessions per forward pass."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specdec.kv_session import KVSession, PlannedForward, run_forwards
from specdec.sampling import SamplingParams, Stream, logits_to_probs, sample_token
from specdec.step_batcher import only_result



@dataclass(frozen=True)
class Drafted:
    """What one session drafted."""

    token_ids: list[int]
    probs: torch.Tensor | None  # q [γ, V] the tokens were drawn from; None when one-hot (greedy)
    alternatives: list[list[int]]  # per drafted position, the draft's next most likely other tokens ([] if not asked)


@dataclass
class DraftJob:
    """One session to draft num_tokens tokens for, and what it has drafted so far."""

    session: KVSession
    num_tokens: int
    params: SamplingParams
    num_alternatives: int
    tokens: list[int] = field(default_factory=list)
    rows: list[torch.Tensor] = field(default_factory=list)  # the q rows [V] the tokens were drawn from
    alternatives: list[list[int]] = field(default_factory=list)

    def add(self, logits: torch.Tensor) -> int:
        """Draws the next token from the draft's logits [V] at this position; returns it."""
        probs = logits_to_probs(logits, self.params)  # [V]
        token = sample_token(probs, self.params, position=len(self.session), stream=Stream.DRAFT)
        self.tokens.append(token)
        self.rows.append(probs)
        if self.num_alternatives:
            ranked = logits.topk(min(self.num_alternatives + 1, logits.shape[-1])).indices.tolist()
            self.alternatives.append([t for t in ranked if t != token][:self.num_alternatives])
        return token

    def result(self) -> Drafted:
        probs = None if self.params.greedy or not self.rows else torch.stack(self.rows)  # [γ, V]
        return Drafted(self.tokens, probs, self.alternatives)


DraftRequest = tuple[KVSession, int, SamplingParams, int]  # session, tokens to draft, sampling, alternatives


def draft_many(requests: Sequence[DraftRequest]) -> list[Drafted | Exception]:
    """Samples num_tokens tokens after each session's sequence and appends them to it.

    Step i feeds every session still drafting in one pass. Returns per request the tokens, the
    distributions q they were drawn from ([γ, V]), or None under greedy decoding, where q is one-hot at the
    drafted token, and per position the num_alternatives most likely other tokens by the draft's logits
    (guesses of what the verifier puts there if it rejects the drafted token); or the error that failed that
    request alone. The last drafted token is left pending: the next extend feeds it, or a rollback drops it
    without it ever being computed.
    """
    results: list[Drafted | Exception | None] = [None] * len(requests)
    live: list[tuple[int, DraftJob, PlannedForward]] = []
    for index, (session, num_tokens, params, num_alternatives) in enumerate(requests):
        job = DraftJob(session, num_tokens, params, num_alternatives)
        if num_tokens == 0:
            results[index] = job.result()
            continue
        try:
            live.append((index, job, session.plan_extend()))
        except Exception as error:  # noqa: BLE001 - reported to that request only
            results[index] = error
    while live:
        still_live = []
        for (index, job, _), logits in zip(live, run_forwards([plan for _, _, plan in live])):
            try:
                token = job.add(logits[-1])
                if len(job.tokens) < job.num_tokens:
                    still_live.append((index, job, job.session.plan_extend([token], score_previous=False)))
                    continue
                job.session.append([token])
                results[index] = job.result()
            except Exception as error:  # noqa: BLE001
                results[index] = error
        live = still_live
    return results


def draft_with_model(session: KVSession, num_tokens: int, params: SamplingParams,
                     num_alternatives: int = 0) -> Drafted:
    """One session's draft (see draft_many); raises its error."""
    return only_result(draft_many([(session, num_tokens, params, num_alternatives)]))
