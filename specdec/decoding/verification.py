"""Verification rounds on target sessions: sync to base_len, score the draft, judge, commit.

`verify_rounds` runs the rounds of many sessions with a single scoring pass (continuous batching), into which
other sessions' prefills can be packed too, then judges them all at once (specdec/sampling/round_judge.py), reading the
device once per step; a round that fails (stale base_len, context overflow, non-finite logits) fails alone.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specdec.common.errors import KVCacheFullError, StaleBaseLenError
from specdec.engine.kv.session import KVSession, PlannedForward, run_forwards
from specdec.engine.step_batcher import only_result
from specdec.sampling.round_judge import DraftRound, judge_rounds
from specdec.sampling.rules import SamplingParams, Verdict
from specdec.sampling.sequence_rules import SequenceRules
from specdec.sampling.token_logprobs import committed_logprobs


@dataclass(frozen=True)
class VerifyTiming:
    """Where a round's time went inside the verifier (ns), and the pass that scored it."""

    forward_ns: int  # the whole scoring pass, shared by every round in it
    sampling_ns: int  # judging every round of the pass, shared likewise
    batch_rows: int = 1  # rounds scored by that pass
    batch_tokens: int = 0  # tokens it fed, over all its rows


@dataclass(frozen=True)
class VerifyJob:
    """One round to run: draft_probs is q [γ, V], or None for one-hot q (ignored under the coupled rule)."""

    session: KVSession
    session_id: str
    base_len: int
    draft_tokens: Sequence[int]
    draft_probs: torch.Tensor | None
    params: SamplingParams
    ends_request: bool = False  # the caller's request ends with this round: no round of the session follows
    rules: SequenceRules | None = None  # penalties, min_p, a constraint (specdec/sampling/sequence_rules.py)
    top_logprobs: int | None = None  # the committed tokens' log-probabilities with this many alternatives; None: off


PassHook = Callable[[int, int, int], None]  # (forward ns, prompt tokens prefilled, tokens fed for rounds)
RoomMaker = Callable[[VerifyJob], bool]  # frees KV blocks for a round that cannot get its own; False: none to free


def verify_rounds(
    jobs: Sequence[VerifyJob],
    prefills: Sequence[PlannedForward] = (),
    on_pass: PassHook | None = None,
    make_room: RoomMaker | None = None,
    first_tokens: Sequence[VerifyJob] = (),
) -> list[tuple[Verdict, VerifyTiming] | Exception]:
    """Truncates each session to its base_len, scores every x_1..x_γ in one pass, judges and commits.

    `prefills` (other sessions' planned prompt prefills, which need no logits) are fed in the same pass.
    `first_tokens` are plain rounds (no draft, base_len the prompt's length) of sessions prefilled by this pass,
    judged on the row their prefill keeps: a session's first token, drawn as plain decoding's first step draws it.
    `on_pass` hears of the pass, if one ran. Rounds take their KV blocks in the order given; one that finds too few
    free asks `make_room` (e.g. to preempt newer sessions) until it fits or nothing is left to free.
    After a round its session holds exactly the committed sequence: base_len tokens + the accepted tokens +
    the recovered or bonus token. Returns per job, then per first token, its verdict and timing, or the error that
    failed it alone.
    """
    every_job = [*jobs, *first_tokens]
    results: list[tuple[Verdict, VerifyTiming] | Exception | None] = [None] * len(every_job)
    planned: list[tuple[int, PlannedForward]] = []
    for index, job in enumerate(jobs):
        try:
            if len(job.session) < job.base_len:
                raise StaleBaseLenError(job.session_id, job.base_len, len(job.session))
            job.session.truncate(job.base_len)
            planned.append((index, _plan_round(job, make_room)))
            _mark_greedy_decoding(job)
        except Exception as error:  # noqa: BLE001 - reported to that round's caller only
            results[index] = error
    if not planned and not prefills:
        return results
    plans = [*(plan for _, plan in planned), *prefills]
    started = time.perf_counter_ns()
    all_logits = run_forwards(plans)[: len(planned)]  # per round [γ+1, V]
    forward_ns = time.perf_counter_ns() - started
    scored_tokens = sum(len(plan.token_ids) for _, plan in planned)
    prefill_tokens = sum(len(plan.token_ids) for plan in prefills)
    batch_tokens = scored_tokens + prefill_tokens
    if on_pass is not None and batch_tokens:  # none ran when every round had its row from a prefill
        on_pass(forward_ns, prefill_tokens, scored_tokens)
    sampling_started = time.perf_counter_ns()
    scored = [(index, logits) for (index, _), logits in zip(planned, all_logits)]
    for offset, job in enumerate(first_tokens):
        _mark_greedy_decoding(job)
        scored.append((len(jobs) + offset, job.session.next_logits))  # [1, V], kept by its prefill
    judged: list[tuple[int, DraftRound, torch.Tensor, int | None]] = []  # (job index, round, its logits, dead row)
    for index, logits in scored:
        try:
            judged.append((index, *_shaped_round(every_job[index], logits)))
        except Exception as error:  # noqa: BLE001 - the constraint engine failed that round alone
            every_job[index].session.truncate(every_job[index].base_len)
            results[index] = error
    try:
        outcomes = judge_rounds([round_ for _, round_, _, _ in judged], [logits for _, _, logits, _ in judged])
    except Exception as error:  # noqa: BLE001 - one that no single round caused fails each of them
        outcomes = [error] * len(judged)
    outcomes = [  # every token before a dead end accepted: the request ends there
        Verdict(o.accepted_tokens, None, is_bonus=False) if isinstance(o, Verdict) and o.num_accepted == dead else o
        for (_, _, _, dead), o in zip(judged, outcomes)
    ]
    raw_logits = dict(scored)  # before the rules shaped them
    outcomes = _with_logprobs([every_job[i] for i, *_ in judged], [raw_logits[i] for i, *_ in judged], outcomes)
    timing = VerifyTiming(forward_ns, time.perf_counter_ns() - sampling_started, len(scored), batch_tokens)
    for (index, _, _, _), outcome in zip(judged, outcomes):
        job = every_job[index]
        if isinstance(outcome, Exception):
            job.session.truncate(job.base_len)
            results[index] = outcome
            continue
        job.session.truncate(job.base_len + outcome.num_accepted)
        job.session.append(outcome.tokens[outcome.num_accepted :])
        results[index] = (outcome, timing)
    return results


def _with_logprobs(
    jobs: Sequence[VerifyJob], logits: Sequence[torch.Tensor], outcomes: list[Verdict | Exception]
) -> list[Verdict | Exception]:
    """The verdicts of the rounds that ask for log-probabilities with them (one more read of the device, for those
    rounds together; none when no round asks). Row i of a round's logits is where its i-th committed token was
    chosen, so accepted, recovered and bonus tokens all get the target's own figures."""
    asking = [
        r for r, (job, o) in enumerate(zip(jobs, outcomes)) if job.top_logprobs is not None and isinstance(o, Verdict)
    ]
    if not asking:
        return outcomes
    found = committed_logprobs(
        [logits[r] for r in asking], [outcomes[r].tokens for r in asking], [jobs[r].top_logprobs for r in asking]
    )
    outcomes = list(outcomes)
    for r, logprobs in zip(asking, found):
        outcomes[r] = dataclasses.replace(outcomes[r], logprobs=tuple(logprobs))
    return outcomes


def verify_round(
    session: KVSession,
    session_id: str,
    base_len: int,
    draft_tokens: Sequence[int],
    draft_probs: torch.Tensor | None,
    params: SamplingParams,
    rules: SequenceRules | None = None,
) -> tuple[Verdict, VerifyTiming]:
    """One session's round (see verify_rounds); raises its error."""
    job = VerifyJob(session, session_id, base_len, draft_tokens, draft_probs, params, rules=rules)
    return only_result(verify_rounds([job]))


def _shaped_round(job: VerifyJob, logits: torch.Tensor) -> tuple[DraftRound, torch.Tensor, int | None]:
    """A round to judge from a job and its logits [γ+1, V] after its rules, and the row where its constraint allows
    no token (None: nowhere). A round with such a row is judged on the drafted tokens before it: drafted tokens from
    there on are never allowed, and the row itself is only used if all before it are accepted, when the request
    ends instead."""
    tokens, probs, dead_row = job.draft_tokens, job.draft_probs, None
    if job.rules is not None:
        shaped = job.rules.shape(logits, job.session.tokens, job.base_len)
        logits, dead_row = shaped.logits, shaped.dead_row
        if dead_row is not None:
            tokens, logits = list(tokens[:dead_row]), logits[: dead_row + 1]
            probs = probs[:dead_row] if probs is not None else None
    return DraftRound(tokens, probs, job.params, job.base_len), logits, dead_row


def _plan_round(job: VerifyJob, make_room: RoomMaker | None) -> PlannedForward:
    """Plans the round's forward; while its blocks are not free, has `make_room` free some and tries again."""
    while True:
        try:
            return job.session.plan_extend(job.draft_tokens)
        except KVCacheFullError:
            if make_room is None or not make_room(job):
                raise


def _mark_greedy_decoding(job: VerifyJob) -> None:
    """Counts the session's plain greedy rounds in a row; from the second on, marks its cache as decoding greedily,
    so that a model process may run the next round's pass, on this one's argmax, before it is asked
    (specdec/engine/model_worker.py GreedyLookahead). A plain round after speculative ones is not marked: the next is
    likely speculative again; nor is a request's last round: no next pass comes, and one run ahead would only
    hold back the next request's."""
    session = job.session
    plain_greedy = not job.draft_tokens and job.params.greedy and job.rules is None  # else the argmax is not the token
    session.plain_greedy_rounds = session.plain_greedy_rounds + 1 if plain_greedy else 0
    session.cache.decodes_greedily = session.plain_greedy_rounds >= 2 and not job.ends_request
