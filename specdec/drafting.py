"""Drafting γ tokens autoregressively from draft-model sessions, many sessions per forward pass."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specdec.kv_session import KVSession, PlannedForward, run_forwards
from specdec.sampling import SamplingParams, Stream, logits_to_probs, row_maxima, sample_token
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
        if not self.params.greedy:
            self.rows.append(probs)
        ranked = logits.topk(min(self.num_alternatives + 1, logits.shape[-1])).indices.tolist() \
            if self.num_alternatives else []
        self.take(token, ranked)
        return token

    def take(self, token: int, ranked: Sequence[int]) -> None:
        """Records a token chosen at this position; `ranked` lists the draft's most likely tokens there
        (at least num_alternatives + 1 of them, most likely first) to take the alternatives from."""
        self.tokens.append(token)
        if self.num_alternatives:
            self.alternatives.append([t for t in ranked if t != token][:self.num_alternatives])

    def result(self) -> Drafted:
        probs = None if self.params.greedy or not self.rows else torch.stack(self.rows)  # [γ, V]
        return Drafted(self.tokens, probs, self.alternatives)


def next_tokens(jobs: Sequence[DraftJob], logits: Sequence[torch.Tensor]) -> list[int | Exception]:
    """Adds every job's next token, drawn from its logits row [V]; returns the tokens or the error of a job.

    Greedy jobs are served together, one top-k (or one max, without alternatives) over their stacked rows, as
    logits_to_probs and sample_token would pick one by one (the argmax, first index on ties); in a large batch of
    short steps the per-row work would otherwise outweigh the model pass. A row with NaN or +inf, or no allowed
    token, goes the one-by-one way, which reports it; so does a row whose two largest logits tie, since top-k
    leaves the order of equal values open. Sampled jobs draw one by one from their own random streams.
    """
    tokens: list[int | Exception | None] = [None] * len(jobs)
    greedy = [index for index, job in enumerate(jobs) if job.params.greedy]
    if greedy:
        stacked = torch.stack([logits[index] for index in greedy]).float()  # [G, V]
        width = min(max(jobs[index].num_alternatives for index in greedy) + 1, stacked.shape[-1])
        if width > 1:
            top_values, top_indices = stacked.topk(width, dim=-1)  # [G, width] each, largest first
            usable = (top_values[:, 0].isfinite() & (top_values[:, 0] > top_values[:, 1])).tolist()  # [G]
            ranked = top_indices.tolist()  # [G, width]
            picked = [indices[0] for indices in ranked]  # [G]
        else:
            largest, first_largest = row_maxima(stacked)  # [G] each
            usable = largest.isfinite().tolist()  # [G]
            picked = first_largest.tolist()  # [G]
            ranked = [[] for _ in greedy]
        for row, index in enumerate(greedy):
            if usable[row]:
                jobs[index].take(picked[row], ranked[row])
                tokens[index] = picked[row]
    for index, job in enumerate(jobs):
        if tokens[index] is None:
            try:
                tokens[index] = job.add(logits[index])
            except Exception as error:  # noqa: BLE001 - that job fails alone
                tokens[index] = error
    return tokens


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
        step_logits = [logits[-1] for logits in run_forwards([plan for _, _, plan in live])]  # per job [V]
        for (index, job, _), token in zip(live, next_tokens([job for _, job, _ in live], step_logits)):
            if isinstance(token, Exception):
                results[index] = token
                continue
            try:
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
