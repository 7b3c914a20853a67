"""Drafting γ tokens autoregressively from draft-model sessions, many sessions per forward pass."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specdec.kv_session import KVSession, PlannedForward, run_forwards
from specdec.sampling import SamplingParams, Stream, coupled_scores, logits_to_probs, row_maxima, sample_token
from specdec.step_batcher import only_result


@dataclass(frozen=True)
class Drafted:
    """What one session drafted."""

    token_ids: list[int]
    probs: torch.Tensor | None  # q [γ, V] the tokens were drawn from; None when one-hot (greedy) or coupled
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
        """Draws the next token from the draft's logits [V] at this position; returns it.

        Under the coupled rule the token is argmax(log q + g) with the position's Gumbel noise g (the one the
        verifier uses), no q is kept, and alternatives are ranked by those perturbed scores: after a rejection
        the verifier emits argmax(log p + g), which the draft's runners-up there name more often than not."""
        probs = logits_to_probs(logits, self.params)  # [V]
        width = min(self.num_alternatives + 1, logits.shape[-1])
        if self.params.coupled:
            scores = coupled_scores(probs.unsqueeze(0), self.params.seed, len(self.session))[0]  # [V]
            token = int(scores.argmax())
            ranked = scores.topk(width).indices.tolist() if self.num_alternatives else []
        else:
            token = sample_token(probs, self.params, position=len(self.session), stream=Stream.DRAFT)
            if not self.params.greedy:
                self.rows.append(probs)
            ranked = logits.topk(width).indices.tolist() if self.num_alternatives else []
        self.take(token, ranked)
        return token

    def take(self, token: int, ranked: Sequence[int]) -> None:
        """Records a token chosen at this position; `ranked` lists the draft's most likely tokens there
        (at least num_alternatives + 1 of them, most likely first) to take the alternatives from."""
        self.tokens.append(token)
        if self.num_alternatives:
            self.alternatives.append([t for t in ranked if t != token][: self.num_alternatives])

    def result(self) -> Drafted:
        probs = torch.stack(self.rows) if self.rows else None  # [γ, V]; none kept when greedy or coupled
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


class DraftRun:
    """Sessions drafting together: every live session's next token in one packed forward pass per step.

    Sessions may be added between steps (iteration-level batching): one that arrives while others draft waits for
    the pass under way, not for all the passes the others still have to make, and each session leaves as soon as
    it has its tokens. The last drafted token of a session is left pending: its next extend feeds it, or a
    rollback drops it without it ever being computed.
    """

    def __init__(self) -> None:
        self._live: list[tuple[object, DraftJob, PlannedForward]] = []  # (caller's key, job, its next forward)

    def __bool__(self) -> bool:
        return bool(self._live)

    @property
    def rows(self) -> int:
        """Sessions the next step feeds."""
        return len(self._live)

    def add(
        self, key: object, session: KVSession, num_tokens: int, params: SamplingParams, num_alternatives: int = 0
    ) -> Drafted | Exception | None:
        """Starts drafting num_tokens tokens after the session's sequence; `key` names it in step()'s results.
        Returns its outcome at once when there is nothing to draft or it cannot start (the error), else None."""
        job = DraftJob(session, num_tokens, params, num_alternatives)
        if num_tokens == 0:
            return job.result()
        try:
            self._live.append((key, job, session.plan_extend()))
        except Exception as error:  # noqa: BLE001 - reported to that session's caller only
            return error
        return None

    def step(self) -> list[tuple[object, Drafted | Exception]]:
        """Runs one forward pass for every live session; returns (key, outcome) of those that finished in it."""
        finished: list[tuple[object, Drafted | Exception]] = []
        still_live = []
        step_logits = [logits[-1] for logits in run_forwards([plan for _, _, plan in self._live])]  # per job [V]
        for (key, job, _), token in zip(self._live, next_tokens([job for _, job, _ in self._live], step_logits)):
            if isinstance(token, Exception):
                finished.append((key, token))
                continue
            try:
                if len(job.tokens) < job.num_tokens:
                    still_live.append((key, job, job.session.plan_extend([token], score_previous=False)))
                    continue
                job.session.append([token])
                finished.append((key, job.result()))
            except Exception as error:  # noqa: BLE001
                finished.append((key, error))
        self._live = still_live
        return finished


def draft_many(requests: Sequence[DraftRequest]) -> list[Drafted | Exception]:
    """Samples num_tokens tokens after each session's sequence and appends them to it, all sessions in one
    DraftRun (one pass per drafted position).

    Returns per request the tokens, the distributions q they were drawn from ([γ, V]), or None under greedy
    decoding, where q is one-hot at the drafted token, and under the coupled rule, whose verifier needs no q;
    and per position the num_alternatives most likely other
    tokens by the draft's logits (guesses of what the verifier puts there if it rejects the drafted token); or the
    error that failed that request alone.
    """
    run = DraftRun()
    results: list[Drafted | Exception | None] = [run.add(index, *request) for index, request in enumerate(requests)]
    while run:
        for index, outcome in run.step():
            results[index] = outcome
    return results


def draft_with_model(session: KVSession, num_tokens: int, params: SamplingParams, num_alternatives: int = 0) -> Drafted:
    """One session's draft (see draft_many); raises its error."""
    return only_result(draft_many([(session, num_tokens, params, num_alternatives)]))
