"""Drafting γ tokens autoregressively from draft-model sessions, many sessions per forward pass."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.kv_session import KVSession, PlannedForward, run_forwards
from specdec.sampling import SamplingParams, Stream, logits_to_probs, sample_token
from specdec.step_batcher import only_result

Drafted = tuple[list[int], torch.Tensor | None]  # tokens, and q [γ, V] (None when one-hot)


@dataclass
class DraftJob:
    """One session to draft num_tokens tokens for, and what it has drafted so far."""

    session: KVSession
    num_tokens: int
    params: SamplingParams
    tokens: list[int]
    rows: list[torch.Tensor]  # the q rows [V] the tokens were drawn from

    def result(self) -> Drafted:
        if self.params.greedy or not self.rows:
            return self.tokens, None
        return self.tokens, torch.stack(self.rows)  # [γ, V]


def draft_many(requests: Sequence[tuple[KVSession, int, SamplingParams]]) -> list[Drafted | Exception]:
    """Samples num_tokens tokens after each session's sequence and appends them to it.

    Step i feeds every session still drafting in one pass. Returns per request the tokens and the
    distributions q they were drawn from ([γ, V]), or None under greedy decoding, where q is one-hot at the
    drafted token; or the error that failed that request alone. The last drafted token is left pending:
    the next extend feeds it, or a rollback drops it without it ever being computed.
    """
    results: list[Drafted | Exception | None] = [None] * len(requests)
    live: list[tuple[int, DraftJob, PlannedForward]] = []
    for index, (session, num_tokens, params) in enumerate(requests):
        job = DraftJob(session, num_tokens, params, [], [])
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
                probs = logits_to_probs(logits[-1], job.params)  # [V]
                token = sample_token(probs, job.params, position=len(job.session), stream=Stream.DRAFT)
                job.tokens.append(token)
                job.rows.append(probs)
                if len(job.tokens) < job.num_tokens:
                    still_live.append((index, job, job.session.plan_extend([token], score_previous=False)))
                    continue
                job.session.append([token])
                results[index] = job.result()
            except Exception as error:  # noqa: BLE001
                results[index] = error
        live = still_live
    return results


def draft_with_model(session: KVSession, num_tokens: int, params: SamplingParams) -> Drafted:
    """One session's draft (see draft_many); raises its error."""
    return only_result(draft_many([(session, num_tokens, params)]))
