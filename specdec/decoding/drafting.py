"""Drafting γ tokens autoregressively from draft-model sessions, many sessions per forward pass."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specdec.common.errors import KVCacheFullError
from specdec.engine.kv.session import ContextOverflowError, KVSession, PlannedForward, run_forwards
from specdec.engine.step_batcher import only_result
from specdec.sampling.draft_sampler import RowRequest, choose_rows
from specdec.sampling.prompt_lookup import lookup_continuation
from specdec.sampling.row_sampling import BAD_LOGITS_MESSAGES, BadLogits, bad_logits_codes, joined_rows
from specdec.sampling.rules import NonFiniteLogitsError, SamplingParams
from specdec.sampling.sequence_rules import SequenceRules, shape_step


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
    lookup_tokens: int = (
        0  # greedy only: lookup tokens to try after the drafted ones (specdec/sampling/prompt_lookup.py)
    )
    lookup: list[int] | None = None  # the lookup tokens in the pass under way, to keep as far as the draft agrees
    rules: SequenceRules | None = None  # penalties, min_p, a constraint (specdec/sampling/sequence_rules.py)
    forced_tokens: int = 0  # tokens the constraint forces that the block may hold beyond num_tokens, with no pass
    forced: int = 0  # forced tokens taken so far

    @property
    def drafted(self) -> int:
        """Tokens the draft model chose so far (forced ones aside)."""
        return len(self.tokens) - self.forced

    def take_forced(self, pending: Sequence[int]) -> list[int]:
        """Takes the tokens the constraint decides after the session's sequence + `pending` (within forced_tokens:
        ConstraintCursor.forced), each with q one-hot where the rule keeps q, as it is chosen, not drawn; returns
        them."""
        if self.rules is None:
            return []
        forced = self.rules.forced([*self.session.tokens, *pending], self.forced_tokens - self.forced)
        model, keeps_q = self.session.model, not self.params.greedy and not self.params.coupled
        for token, instead in forced:
            one_hot = torch.zeros(model.vocab_size, device=model.device) if keeps_q else None  # [V]
            if one_hot is not None:
                one_hot[token] = 1.0
            self.take(token, [token, *instead], one_hot)
        self.forced += len(forced)
        return [token for token, _ in forced]

    def take(self, token: int, ranked: Sequence[int], probs: torch.Tensor | None = None) -> None:
        """Records a token chosen at this position, and the q row [V] it was drawn from under the rejection rule.

        - ranked: the draft's most likely tokens there (up to num_alternatives + 1 of them, most likely first, by
          the logits, or under the coupled rule by log q + g), to take the alternatives from; -1 for none (a token
          the rules refuse).
        """
        self.tokens.append(token)
        if probs is not None:
            self.rows.append(probs)
        if self.num_alternatives:
            self.alternatives.append([t for t in ranked if t != token and t >= 0][: self.num_alternatives])

    def start_lookup(self, pending: Sequence[int]) -> PlannedForward | None:
        """After the last drafted token (and the forced ones after it, `pending`): the pass that scores them and
        the lookup tokens after them, or None when there is nothing to look up (not greedy, lookup off, no earlier
        copy, no room left)."""
        if not self.lookup_tokens or not self.params.greedy:
            return None
        lookup = lookup_continuation([*self.session.tokens, *pending], self.lookup_tokens)
        if not lookup:
            return None
        try:
            lookup_pass = self.session.plan_extend([*pending, *lookup], score_previous=False)
        except (ContextOverflowError, KVCacheFullError):  # no room for the lookup: the block ends as drafted
            return None
        self.lookup = lookup
        return lookup_pass

    def confirm_lookup(self, logits: torch.Tensor) -> Drafted:
        """Keeps the lookup tokens as far as the draft's argmax agrees, then the draft's own token where they part
        (or after the last); rolls the rest back, all of them if a row is bad (BadLogits: NaN or +inf, or no token
        allowed). logits [.., V]: its last k + 1 rows after the last drafted (or forced) token and each lookup
        token."""
        lookup, dead_row = self.lookup, None
        logits = logits[-len(lookup) - 1 :]  # [k + 1, V]
        if self.rules is not None:
            shaped = self.rules.shape(logits, self.session.tokens, len(self.session) - len(lookup))
            logits, dead_row = shaped.logits, shaped.dead_row
        top = torch.topk(logits, self.num_alternatives + 1, dim=-1)  # values, indices [k + 1, A + 1]
        if bad_logits_codes(top.values[:, 0]).any():  # the block ends as drafted
            self.session.truncate(len(self.session) - len(lookup))
            return self.result()
        ranked = top.indices.masked_fill(top.values == float("-inf"), -1).tolist()  # [k + 1, A + 1]
        kept, last = 0, len(lookup) if dead_row is None else dead_row  # no token at or after a dead end
        while kept < min(len(lookup), last) and ranked[kept][0] == lookup[kept]:
            kept += 1
        self.session.truncate(len(self.session) - len(lookup) + kept)
        own = [] if kept == dead_row else [ranked[kept][0]]
        self.session.append(own)  # the draft's own token stays pending, as every last drafted one
        for position, token in enumerate([*lookup[:kept], *own]):
            self.take(token, ranked[position])
        return self.result()

    def result(self) -> Drafted:
        probs = torch.stack(self.rows) if self.rows else None  # [γ, V]; none kept when greedy or coupled
        return Drafted(self.tokens, probs, self.alternatives)


def next_tokens(jobs: Sequence[DraftJob], logits: torch.Tensor) -> list[int | Exception | None]:
    """Adds every job's next token from its row of logits [K, V] (choose_rows: one read back); returns the tokens.

    - a job whose row has NaN or +inf, or no allowed token, gets its NonFiniteLogitsError instead, alone;
    - a job whose constraint allows no token there gets None: its block ends before it.
    """
    ended: dict[int, Exception | None] = {}  # rows whose rules end them: None at a dead end, else their error
    if any(job.rules is not None for job in jobs):
        shaped = shape_step([job.rules for job in jobs], logits, [job.session.tokens for job in jobs])
        logits, ended = shaped.logits, shaped.ended
    requests = [RowRequest(job.params, len(job.session), job.num_alternatives) for job in jobs]
    tokens: list[int | Exception | None] = []
    for row, (job, choice) in enumerate(zip(jobs, choose_rows(logits, requests))):
        if row in ended:
            tokens.append(ended[row])
        elif choice.bad_logits:
            tokens.append(NonFiniteLogitsError(BAD_LOGITS_MESSAGES[BadLogits(choice.bad_logits)]))
        else:
            job.take(choice.token, choice.ranked, choice.probs)
            tokens.append(choice.token)
    return tokens


# session, tokens to draft, sampling, alternatives, the session's rules (penalties, min_p, constraint) or None
DraftRequest = tuple[KVSession, int, SamplingParams, int, SequenceRules | None]


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

    @property
    def runs_a_pass(self) -> bool:
        """Whether the next step runs the model (not when every session's row was kept by its prefill)."""
        return any(plan.token_ids for _, _, plan in self._live)

    def add(
        self,
        key: object,
        session: KVSession,
        num_tokens: int,
        params: SamplingParams,
        num_alternatives: int = 0,
        lookup_tokens: int = 0,
        rules: SequenceRules | None = None,
        forced_tokens: int = 0,
    ) -> Drafted | Exception | None:
        """Starts drafting num_tokens tokens after the session's sequence (then, greedy, up to lookup_tokens lookup
        tokens the draft agrees with and its own next one), and wherever its constraint forces a token, that token
        with no pass (up to forced_tokens of them); `key` names it in step()'s results. Returns its outcome at once
        when there is nothing to draft or it cannot start (the error), else None."""
        job = DraftJob(
            session,
            num_tokens,
            params,
            num_alternatives,
            lookup_tokens=lookup_tokens,
            rules=rules,
            forced_tokens=forced_tokens,
        )
        if num_tokens == 0:
            return job.result()
        try:
            params.validate()
            self._live.append((key, job, session.plan_extend(job.take_forced([]))))
        except Exception as error:  # noqa: BLE001 - reported to that session's caller only
            return error
        return None

    def step(self) -> list[tuple[object, Drafted | Exception]]:
        """Runs one forward pass for every live session; returns (key, outcome) of those that finished in it."""
        finished: list[tuple[object, Drafted | Exception]] = []
        if not self._live:
            return finished
        still_live = []
        forwards = run_forwards([plan for _, _, plan in self._live])  # per job [logit rows, V]
        drafting = []  # indices of the jobs whose pass chose their next token
        for index, (key, job, _) in enumerate(self._live):
            if job.lookup is None:
                drafting.append(index)
                continue
            try:
                finished.append((key, job.confirm_lookup(forwards[index])))
            except Exception as error:  # noqa: BLE001
                finished.append((key, error))
        if not drafting:
            self._live = []
            return finished
        step_logits = joined_rows([forwards[index][-1:] for index in drafting])  # [K, V]
        tokens = next_tokens([self._live[index][1] for index in drafting], step_logits)
        for index, token in zip(drafting, tokens):
            key, job, _ = self._live[index]
            if isinstance(token, Exception):
                finished.append((key, token))
                continue
            if token is None:  # the constraint allows nothing here: the block ends as drafted
                finished.append((key, job.result()))
                continue
            try:
                pending = [token, *job.take_forced([token])]
                if job.drafted < job.num_tokens:
                    still_live.append((key, job, job.session.plan_extend(pending, score_previous=False)))
                elif (lookup_pass := job.start_lookup(pending)) is not None:
                    still_live.append((key, job, lookup_pass))
                else:
                    job.session.append(pending)
                    finished.append((key, job.result()))
            except Exception as error:  # noqa: BLE001
                finished.append((key, error))
        self._live = still_live
        return finished


def draft_many(requests: Sequence[DraftRequest], forced_tokens: int = 0) -> list[Drafted | Exception]:
    """Samples num_tokens tokens after each session's sequence and appends them to it, all sessions in one
    DraftRun (one pass per drafted position).

    Returns per request the tokens, the distributions q they were drawn from ([γ, V]), or None under greedy
    decoding, where q is one-hot at the drafted token, and under the coupled rule, whose verifier needs no q;
    and per position the num_alternatives most likely other
    tokens by the draft's logits (guesses of what the verifier puts there if it rejects the drafted token); or the
    error that failed that request alone. Each block may also hold up to forced_tokens tokens its constraint
    forces (DraftRun.add).
    """
    run = DraftRun()
    results: list[Drafted | Exception | None] = [
        run.add(index, *request[:4], rules=request[4], forced_tokens=forced_tokens)
        for index, request in enumerate(requests)
    ]
    while run:
        for index, outcome in run.step():
            results[index] = outcome
    return results


def draft_with_model(
    session: KVSession,
    num_tokens: int,
    params: SamplingParams,
    num_alternatives: int = 0,
    rules: SequenceRules | None = None,
    forced_tokens: int = 0,
) -> Drafted:
    """One session's draft (see draft_many), with up to forced_tokens tokens its constraint forces beyond
    num_tokens (DraftRun.add); raises its error."""
    return only_result(draft_many([(session, num_tokens, params, num_alternatives, rules)], forced_tokens))
