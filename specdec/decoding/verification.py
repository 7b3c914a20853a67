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

from specdec.common.errors import StaleBaseLenError
from specdec.engine.kv.session import KVSession, PlannedForward, run_forwards
from specdec.engine.step_batcher import only_result
from specdec.sampling.round_judge import DraftRound, judge_rounds
from specdec.sampling.rules import SamplingParams, Verdict
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
    top_logprobs: int | None = None  # the committed tokens' log-probabilities with this many alternatives; None: off


PassHook = Callable[[int, int, int], None]  # (forward ns, prompt tokens prefilled, tokens fed for rounds)


def verify_rounds(
    jobs: Sequence[VerifyJob], prefills: Sequence[PlannedForward] = (), on_pass: PassHook | None = None
) -> list[tuple[Verdict, VerifyTiming] | Exception]:
    """Truncates each session to its base_len, scores every x_1..x_γ in one pass, judges and commits.

    `prefills` (other sessions' planned prompt prefills, which need no logits) are fed in the same pass.
    `on_pass` hears of the pass, if one ran.
    After a round its session holds exactly the committed sequence: base_len tokens + the accepted tokens +
    the recovered or bonus token. Returns per job its verdict and timing, or the error that failed it alone.
    """
    results: list[tuple[Verdict, VerifyTiming] | Exception | None] = [None] * len(jobs)
    planned: list[tuple[int, PlannedForward]] = []
    for index, job in enumerate(jobs):
        try:
            if len(job.session) < job.base_len:
                raise StaleBaseLenError(job.session_id, job.base_len, len(job.session))
            job.session.truncate(job.base_len)
            planned.append((index, job.session.plan_extend(job.draft_tokens)))
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
    rounds = [
        DraftRound(jobs[i].draft_tokens, jobs[i].draft_probs, jobs[i].params, jobs[i].base_len) for i, _ in planned
    ]
    try:
        outcomes = judge_rounds(rounds, all_logits)
    except Exception as error:  # noqa: BLE001 - one that no single round caused fails each of them
        outcomes = [error] * len(rounds)
    outcomes = _with_logprobs([jobs[i] for i, _ in planned], all_logits, outcomes)
    timing = VerifyTiming(forward_ns, time.perf_counter_ns() - sampling_started, len(planned), batch_tokens)
    for (index, _), outcome in zip(planned, outcomes):
        job = jobs[index]
        if isinstance(outcome, Exception):
            job.session.truncate(job.base_len)
            results[index] = outcome
            continue
        job.session.truncate(job.base_len + outcome.num_accepted)
        job.session.append([outcome.next_token])
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
) -> tuple[Verdict, VerifyTiming]:
    """One session's round (see verify_rounds); raises its error."""
    return only_result(verify_rounds([VerifyJob(session, session_id, base_len, draft_tokens, draft_probs, params)]))


def _mark_greedy_decoding(job: VerifyJob) -> None:
    """Counts the session's plain greedy rounds in a row; from the second on, marks its cache as decoding greedily,
    so that a model process may run the next round's pass, on this one's argmax, before it is asked
    (specdec/engine/model_worker.py GreedyLookahead). A plain round after speculative ones is not marked: the next is
    likely speculative again; nor is a request's last round: no next pass comes, and one run ahead would only
    hold back the next request's."""
    session = job.session
    plain_greedy = not job.draft_tokens and job.params.greedy
    session.plain_greedy_rounds = session.plain_greedy_rounds + 1 if plain_greedy else 0
    session.cache.decodes_greedily = session.plain_greedy_rounds >= 2 and not job.ends_request
