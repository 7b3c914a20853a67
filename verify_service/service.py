"""The verify service's logic as a plain object: target sessions and verification rounds. No grpc here."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.common.errors import InvalidFieldError, KVCacheFullError
from specdec.decoding.verification import PassHook, VerifyJob, VerifyTiming, verify_rounds
from specdec.engine.kv.preemption import PreemptHook, Preemptions
from specdec.engine.kv.session import KVSession, PlannedForward
from specdec.engine.model_runtime import LoadedModel
from specdec.engine.step_batcher import NOT_YET, FollowUpChoice, NotYet, only_result
from specdec.engine.step_cost import calibrate
from specdec.sampling.constraints import ConstraintCompiler, ConstraintSpec
from specdec.sampling.rules import SamplingParams, Verdict
from specdec.sampling.sequence_rules import SequenceRules, session_rules
from specdec.serving.session_store import SessionStore
from specdec.serving.wire import PLAIN_STEP
from verify_service.settings import VerifySettings
from verify_service.tensor_parallel import TensorParallelLeader

OPEN, VERIFY, LAST_VERIFY = "open", "verify", "last_verify"  # the calls a model step takes (step_many)
ROUND_KINDS = (VERIFY, LAST_VERIFY)  # LAST_VERIFY: a round after which its request ends (its caller's hint says so)


@dataclass
class TargetSession:
    """A target KV session and the sampling settings its verdicts use."""

    kv: KVSession
    params: SamplingParams
    rules: SequenceRules | None = None  # penalties, min_p, a constraint
    top_logprobs: int | None = None  # verdicts carry their tokens' log-probabilities with this many alternatives

    def __len__(self) -> int:
        return len(self.kv)


@dataclass(frozen=True)
class Opened:
    """An opened session: its prefill step's time, and the first token when the open asked for it."""

    prefill_ns: int
    first: tuple[Verdict, VerifyTiming, int] | None = None  # as a round's result: verdict, timing, new length


@dataclass(frozen=True)
class OpenCall:
    """One open of a step: the session, its prompt and settings, its constraint and where its output starts (0: at
    the prompt's end), and whether to draw its first token."""

    session_id: str
    prompt_ids: Sequence[int]
    params: SamplingParams
    constraint: ConstraintSpec | None = None
    output_start: int = 0
    draws_first_token: bool = False
    top_logprobs: int | None = None  # its verdicts carry log-probabilities with this many alternatives; None: off


@dataclass(frozen=True)
class GuessedRound:
    """A session's next round drafted under a guessed verdict of the round before it."""

    num_accepted: int  # the guessed verdict: drafted tokens accepted,
    next_token: int  # ...and the recovered or bonus token after them
    draft_tokens: Sequence[int]
    draft_probs: torch.Tensor | None  # q [γ, V]; None: one-hot


class VerifyService:
    """Holds target sessions and answers open / verify / close.

    Under tensor parallelism `ranks` is rank 0's TensorParallelLeader: sessions then run on its MirroredModel,
    so every rank runs each step's one packed pass, and the sampler still runs once, here.
    `on_pass(forward_ns, prefill_tokens, scored_tokens)` hears of every scoring pass (e.g. the pass metrics),
    `on_preempt()` of every session preempted to free KV blocks.
    """

    def __init__(
        self,
        settings: VerifySettings,
        model: LoadedModel,
        ranks: TensorParallelLeader | None = None,
        on_pass: PassHook | None = None,
        on_preempt: PreemptHook | None = None,
    ):
        self.settings = settings
        self.model = model
        self.ranks = ranks
        self.on_pass = on_pass
        self.sessions: SessionStore[TargetSession] = SessionStore(
            settings.max_sessions, lambda s: s.kv.cached_len, lambda s: s.kv.truncate(0)
        )
        self.sessions_model = model if ranks is None else ranks.mirrored  # the model every session runs on
        self.preemptions = Preemptions(on_preempt)  # a full KV cache preempts the newest sessions
        self.step_cost = calibrate(self.sessions_model)  # what a pass costs, for the policy
        self.constraints = ConstraintCompiler(
            model.tokenizer, model.vocab_size, model.eos_token_ids, settings.constraint_limits()
        )

    def open(
        self,
        session_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        constraint: ConstraintSpec | None = None,
        output_start: int = 0,
        draws_first_token: bool = False,
        top_logprobs: int | None = None,
    ) -> Opened:
        """Opens a session and prefills the prompt, keeping its last row for the first round, or drawing the first
        token from it (draws_first_token): the first token comes with the prefill, as plain decoding draws it. The
        constraint and the penalties cover the tokens from output_start (0: the prompt's end); with top_logprobs its
        verdicts carry log-probabilities with that many alternatives."""
        call = OpenCall(session_id, prompt_ids, params, constraint, output_start, draws_first_token, top_logprobs)
        return only_result(self.open_many([call]))

    def open_many(self, opens: Sequence[OpenCall]) -> list[Opened | Exception]:
        """Opens sessions and prefills them in one pass; per open what it gives, or its error."""
        return self._step(opens, [])[0]

    def verify(
        self, session_id: str, base_len: int, draft_tokens: Sequence[int], draft_probs: torch.Tensor | None
    ) -> tuple[Verdict, VerifyTiming, int]:
        """Runs one round (sync to base_len, score, judge, commit); returns the verdict, timing and new length."""
        return only_result(self.verify_many([(session_id, base_len, draft_tokens, draft_probs)]))

    def verify_many(
        self, rounds: Sequence[tuple[str, int, Sequence[int], torch.Tensor | None]]
    ) -> list[tuple[Verdict, VerifyTiming, int] | Exception]:
        """Runs the rounds of several sessions (one round per session) with one scoring pass; per round
        (verdict, timing, new length) or the error that failed it alone."""
        return self._step([], rounds)[1]

    def step_many(self, calls: Sequence[tuple]) -> list:
        """One model step for the queued calls of distinct sessions, each (session_id, OPEN, prompt_ids, params[,
        constraint, output_start, draws_first_token, top_logprobs]) or (session_id, VERIFY, base_len, draft_tokens,
        draft_probs): new sessions' prefills are packed into the rounds' scoring pass, so an arriving request adds its
        prompt's tokens to a pass instead of a pass of its own that every running session would wait for. Per call
        what open_many / verify_many return for it."""
        kinds = [kind for _, kind, *_ in calls]
        opens = [OpenCall(session_id, *rest) for session_id, kind, *rest in calls if kind == OPEN]
        rounds = [(session_id, *rest) for session_id, kind, *rest in calls if kind in ROUND_KINDS]
        if len(opens) + len(rounds) != len(calls):
            raise ValueError(f"step calls must be {OPEN!r} or one of {ROUND_KINDS}, got {sorted(set(kinds))}")
        last_rounds = [kind == LAST_VERIFY for kind in kinds if kind in ROUND_KINDS]
        open_results, round_results = (iter(results) for results in self._step(opens, rounds, last_rounds))
        return [next(open_results) if kind == OPEN else next(round_results) for kind in kinds]

    def check_draft_length(self, draft_tokens: Sequence[int], field: str = "draft_token_ids") -> None:
        """Raises InvalidFieldError(field) for a draft longer than max_speculative_tokens."""
        limit = self.settings.max_speculative_tokens
        if len(draft_tokens) > limit:
            raise InvalidFieldError(field, f"{len(draft_tokens)} tokens exceed the limit of {limit}")

    def next_round_choice(
        self,
        session_id: str,
        after_base_len: int,
        rounds: Sequence[GuessedRound],
        plain_otherwise: bool,
        kind: str = VERIFY,
    ) -> FollowUpChoice:
        """For the step batcher's follow-up: given the result of the session's last round (verdict, timing, length),
        the step call of the guessed round its verdict matches, tagged with that round's index, or a plain step
        (PLAIN_STEP) when none does and plain_otherwise; None when nothing runs, including when the last round is
        not the one at after_base_len (it was rolled back, or a later round already ran); NOT_YET while the session
        is no longer than after_base_len (that round has not run: the follow-up overtook it). The call is of `kind`
        (LAST_VERIFY when the request ends with it). Raises SessionNotFoundError for a session that is not open."""

        def choose(last: object) -> tuple[int, tuple] | NotYet | None:
            session = self.sessions.get(session_id)
            if isinstance(last, Exception) or self.preemptions.is_preempted(session_id):
                return None  # that round failed (its caller is told), or the session must queue for blocks first
            if len(session) <= after_base_len:
                return NOT_YET
            if isinstance(last, Opened):  # the open ran last: its first token is a plain round's verdict
                last = last.first
            if not isinstance(last, tuple):  # the open, without a first token, ran last
                return None
            verdict, _, session_len = last
            if verdict.dead_end or session_len - verdict.num_accepted - 1 != after_base_len:
                return None
            for index, guessed in enumerate(rounds):
                if (guessed.num_accepted, guessed.next_token) == (verdict.num_accepted, verdict.next_token):
                    return index, (session_id, kind, session_len, guessed.draft_tokens, guessed.draft_probs)
            return (PLAIN_STEP, (session_id, kind, session_len, [], None)) if plain_otherwise else None

        return choose

    def _step(
        self,
        opens: Sequence[OpenCall],
        rounds: Sequence[tuple[str, int, Sequence[int], torch.Tensor | None]],
        last_rounds: Sequence[bool] = (),
    ) -> tuple[list, list]:
        """Opens `opens` and runs `rounds` in one packed pass: (per open an Opened or its error, per round (verdict,
        timing, new length) or its error). last_rounds: per round whether its request ends with it (none does when
        empty)."""
        open_results: list[Opened | Exception | None] = [None] * len(opens)
        opened, prefills, first_tokens = self._plan_opens(opens, open_results)
        round_results: list[tuple[Verdict, VerifyTiming, int] | Exception | None] = [None] * len(rounds)
        jobs: list[tuple[int, VerifyJob]] = []
        for index, (session_id, base_len, draft_tokens, draft_probs) in enumerate(rounds):
            try:
                self.check_draft_length(draft_tokens)
                session = self.sessions.get(session_id)
                self.preemptions.check_runnable(session_id, session.kv)
                jobs.append(
                    (
                        index,
                        VerifyJob(
                            session.kv,
                            session_id,
                            base_len,
                            draft_tokens,
                            draft_probs,
                            session.params,
                            ends_request=bool(last_rounds) and last_rounds[index],
                            rules=session.rules,
                            top_logprobs=session.top_logprobs,
                        ),
                    )
                )
            except Exception as error:  # noqa: BLE001
                round_results[index] = error
        jobs.sort(key=lambda item: self.preemptions.order(item[1].session_id))  # the oldest take blocks first
        opening = {opens[index].session_id for index in opened}  # their prefills hold planned blocks: never preempted

        def make_room(job: VerifyJob) -> bool:
            return self.preemptions.make_room(job.session_id, self._kv_of, opening)

        started = time.perf_counter_ns()
        try:
            outcomes = verify_rounds(
                [job for _, job in jobs], prefills, self.on_pass, make_room, [job for _, job in first_tokens]
            )
        except Exception:
            for index in opened:
                self.close(opens[index].session_id)
            raise
        step_ns = time.perf_counter_ns() - started
        for index in opened:
            open_results[index] = Opened(step_ns)
        for (index, job), outcome in zip(jobs, outcomes):
            if isinstance(outcome, KVCacheFullError):  # cannot grow, even with every newer session preempted
                outcome = self.preemptions.preempt(job.session_id, job.session)
            elif not isinstance(outcome, Exception):
                self.preemptions.ran(job.session_id)
            round_results[index] = outcome if isinstance(outcome, Exception) else (*outcome, len(job.session))
        for (index, job), outcome in zip(first_tokens, outcomes[len(jobs) :]):
            if isinstance(outcome, Exception):  # the open fails with its first token
                self.close(job.session_id)
                open_results[index] = outcome
            else:
                open_results[index] = Opened(step_ns, (*outcome, len(job.session)))
        return open_results, round_results

    def _plan_opens(
        self, opens: Sequence[OpenCall], open_results: list
    ) -> tuple[list[int], list[PlannedForward], list[tuple[int, VerifyJob]]]:
        """Adds the opens' sessions and plans their prefills; an open that fails gets its error in open_results.
        Returns the indexes of the opened ones, their prefills, and per open that draws its first token (its index,
        its plain round on the row its prefill keeps)."""
        opened: list[int] = []
        prefills: list[PlannedForward] = []
        first_tokens: list[tuple[int, VerifyJob]] = []
        for index, call in enumerate(opens):
            try:
                rules = session_rules(
                    self.constraints, call.params, len(call.prompt_ids), call.constraint, call.output_start
                )
                self.sessions.reserve(call.session_id)
                kv = KVSession(self.sessions_model, call.prompt_ids)
                session = TargetSession(kv, call.params, rules, call.top_logprobs)
                self.sessions.add(call.session_id, session)
                self.preemptions.arrived(call.session_id)
            except Exception as error:  # noqa: BLE001 - that open fails alone
                open_results[index] = error
                continue
            try:
                if (plan := session.kv.plan_prefill()) is not None:  # holds the prompt's KV blocks, or KVCacheFullError
                    prefills.append(plan)
                opened.append(index)
            except Exception as error:  # noqa: BLE001
                self.close(call.session_id)
                open_results[index] = error
                continue
            if call.draws_first_token:
                base_len = len(call.prompt_ids)
                job = VerifyJob(
                    session.kv,
                    call.session_id,
                    base_len,
                    [],
                    None,
                    call.params,
                    rules=rules,
                    top_logprobs=call.top_logprobs,
                )
                first_tokens.append((index, job))
        return opened, prefills, first_tokens

    def preempted_tokens(self, session_id: str) -> int:
        """The tokens a preempted session recomputes when it runs again; 0 when it is not preempted (or not open)."""
        session = self.sessions.peek(session_id)
        return len(session) if session is not None and self.preemptions.is_preempted(session_id) else 0

    def _kv_of(self, session_id: str) -> KVSession | None:
        session = self.sessions.peek(session_id)
        return session.kv if session is not None else None

    def close(self, session_id: str) -> bool:
        """Drops a session; under tensor parallelism the ranks drop their copy of its cache with the next step."""
        self.preemptions.left(session_id)
        return self.sessions.close(session_id)
