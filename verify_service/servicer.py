"""The Verifier gRPC servicer: decodes requests, queues them for VerifyService's model thread, encodes replies.

Opens and Verify calls that arrive while a step runs are batched into the next step (specdec/engine/step_batcher.py),
opens and rounds together: new sessions' prefills share the rounds' pass.

Under a KV budget an open first queues for its blocks until its call's deadline (specdec/engine/kv/admission.py); a
round whose session was preempted meanwhile queues likewise, ahead of new sessions, then runs and recomputes the
session (specdec/engine/kv/preemption.py). Once the replica drains, opens are refused and replies say `draining`.
A session's calls may also come as messages on its call stream (CallStream, specdec/serving/call_stream.py), each
answered by the same method as its unary call.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import nullcontext

from specdec.common.errors import DownstreamUnavailableError, InvalidFieldError, KVCacheFullError, SessionPreemptedError
from specdec.engine.kv.admission import KVAdmission, WaitHook
from specdec.engine.step_batcher import StepBatcher
from specdec.serving.call_stream import CallStreamServer, streamed_methods
from specdec.serving.drain import SessionDrain
from specdec.serving.session_store import expire_idle_sessions
from specdec.serving.wire import (
    call_deadline,
    check_token_ids,
    checked_top_logprobs,
    constraint_from_proto,
    ends_after,
    follows_at_once,
    kv_block_info,
    logprob_to_proto,
    probs_from_proto,
    session_sampling_from_proto,
)
from specdec.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from verify_service.service import LAST_VERIFY, OPEN, VERIFY, GuessedRound, Opened, VerifyService


def _round_follows(hint: verifier_pb2.NextCallHint) -> Callable[[tuple], bool]:
    """For the batcher: whether the caller's next round follows a round's result (verdict, timing, length) at once
    (never after a dead end: the request ends)."""
    return lambda result: not result[0].dead_end and follows_at_once(hint, result[0].num_accepted, result[0].next_token)


def _first_token_follows(hint: verifier_pb2.NextCallHint) -> Callable[[Opened], bool]:
    """For the batcher: whether the caller's first round follows an open's first token at once."""
    return lambda opened: (
        opened.first is not None
        and not opened.first[0].dead_end
        and follows_at_once(hint, 0, opened.first[0].next_token)
    )


def _round_kind(request: verifier_pb2.VerifyRequest | verifier_pb2.VerifyNextRequest) -> str:
    """LAST_VERIFY for a round whose hint says the request ends with it, VERIFY otherwise."""
    return LAST_VERIFY if request.HasField("next_call") and ends_after(request.next_call) else VERIFY


def _verify_response(verdict, timing, session_len: int, draining: bool) -> verifier_pb2.VerifyResponse:
    return verifier_pb2.VerifyResponse(
        accepted_token_ids=verdict.accepted_tokens,
        next_token_id=verdict.next_token if not verdict.dead_end else 0,
        is_bonus=verdict.is_bonus,
        constraint_dead_end=verdict.dead_end,
        session_len=session_len,
        forward_ns=timing.forward_ns,
        sampling_ns=timing.sampling_ns,
        batch_rows=timing.batch_rows,
        batch_tokens=timing.batch_tokens,
        draining=draining,
        logprobs=[logprob_to_proto(logprob) for logprob in verdict.logprobs],
    )


class VerifierServicer(verifier_pb2_grpc.VerifierServicer):
    """Thin shell over VerifyService; model work runs on one batching worker thread so the event loop stays free.

    Under tensor parallelism a failed rank group fails the calls in flight at once (`ranks_failed`, called
    on the event loop), even while the model thread is still stuck in a collective, and every later call.
    """

    def __init__(
        self,
        service: VerifyService,
        tensor_parallel_size: int = 1,
        on_step: Callable[[str, int], None] | None = None,
        on_queue_wait: WaitHook | None = None,
    ):
        self.service = service
        self.tensor_parallel_size = tensor_parallel_size
        self._batcher = StepBatcher(
            {"step": service.step_many},
            service.settings.max_batch_size,
            "verify-model",
            on_step,
            service.settings.max_batch_wait_ms / 1000,
            thread_cpus=service.settings.model_thread_cpus(),
        )
        self._calls = CallStreamServer(streamed_methods(self, verifier_pb2.DESCRIPTOR.services_by_name["Verifier"]))
        self._ranks_failed = asyncio.Event()
        model = service.model
        self.admission = (
            KVAdmission(model.kv_pool, service.settings.kv_queue_limit, on_queue_wait) if model.packed else None
        )
        self.drain = SessionDrain(service.sessions)

    def ranks_failed(self) -> None:
        """The tensor-parallel group failed: wake the calls waiting on it."""
        self._ranks_failed.set()

    async def _run(
        self,
        kind_or_fn: str | Callable,
        *args,
        follows: Callable | None = None,
        choose: Callable | None = None,
        urgent: bool = False,
    ):
        """Runs a batchable kind ("step") or a one-off function on the model thread; `follows(result)`: whether
        the session's next call comes at once; with `choose`, args is the session and the call is a follow-up of
        its last one; an `urgent` step (an open) does not wait for other sessions' next calls
        (specdec/engine/step_batcher.py)."""
        ranks = self.service.ranks
        if ranks is not None:
            ranks.raise_if_failed()
        if choose is not None:
            work = self._batcher.submit_follow_up(kind_or_fn, *args, choose, follows=follows)
        elif isinstance(kind_or_fn, str):
            work = self._batcher.submit(kind_or_fn, *args, follows=follows, urgent=urgent)
        else:
            work = self._batcher.run(kind_or_fn, *args)
        if ranks is None:
            return await work
        failed = asyncio.ensure_future(self._ranks_failed.wait())
        try:
            await asyncio.wait([work, failed], return_when=asyncio.FIRST_COMPLETED)
        finally:
            failed.cancel()
        if work.done():
            return work.result()
        work.add_done_callback(lambda f: f.cancelled() or f.exception())  # a stuck step ends later, already reported
        ranks.raise_if_failed()
        raise DownstreamUnavailableError("tensor-parallel ranks unavailable")

    async def expire_idle_sessions(self) -> None:
        """Runs until cancelled: closes sessions idle past --session-idle-ttl-s (specdec/serving/session_store.py)."""
        service = self.service
        await expire_idle_sessions(service.sessions, service.settings.session_idle_ttl_s, service.close, self._run)

    def close(self) -> None:
        """Ends the model thread once the server has stopped (without waiting for a step stuck on failed ranks)."""
        ranks = self.service.ranks
        self._batcher.close(wait=ranks is None or ranks.failure is None)

    async def OpenSession(
        self, request: verifier_pb2.OpenVerifySessionRequest, context
    ) -> verifier_pb2.OpenVerifySessionResponse:
        prompt = check_token_ids(request.prompt_token_ids, self.service.model.vocab_size, "prompt_token_ids")
        params = session_sampling_from_proto(request.sampling, request.sampling_rule)
        self.drain.refuse_if_draining()
        top_logprobs = checked_top_logprobs(request.logprobs, request.top_logprobs)
        constraint = constraint_from_proto(request.constraint)
        if constraint is not None:  # compiled (or found in the cache) off the model thread, which opens with it
            await asyncio.to_thread(self.service.constraints.compile, constraint)
        first = request.draw_first_token
        follows = _first_token_follows(request.next_call) if first and request.HasField("next_call") else None
        call = (request.session_id, OPEN, prompt, params, constraint, request.output_start, first, top_logprobs)
        if self.admission is None:
            opened = await self._run("step", *call, follows=follows, urgent=True)
        else:
            opened = await self._open_admitted(call, len(prompt), call_deadline(context), follows)
        if opened.first is None:
            return verifier_pb2.OpenVerifySessionResponse(session_len=len(prompt), prefill_ns=opened.prefill_ns)
        verdict, _, session_len = opened.first
        if verdict.dead_end:  # the constraint allows no first token: the request ends
            return verifier_pb2.OpenVerifySessionResponse(
                session_len=session_len, prefill_ns=opened.prefill_ns, constraint_dead_end=True
            )
        return verifier_pb2.OpenVerifySessionResponse(
            session_len=session_len,
            prefill_ns=opened.prefill_ns,
            first_token_id=verdict.next_token,
            first_token_logprob=logprob_to_proto(verdict.logprobs[0]) if verdict.logprobs else None,
        )

    async def _open_admitted(
        self, call: tuple, prompt_tokens: int, deadline: float | None, follows: Callable | None
    ) -> Opened:
        """Runs the open step `call` once the prompt's blocks are free; an open whose blocks went to growing sessions
        meanwhile queues again, ahead of new sessions."""
        blocks = self.admission.blocks_needed(prompt_tokens)
        resuming = False
        while True:
            async with self.admission.admitted(blocks, deadline, resuming):
                try:
                    return await self._run("step", *call, follows=follows, urgent=True)
                except KVCacheFullError:
                    resuming = True

    async def _round(self, session_id: str, *args, follows: Callable | None, deadline: float | None, drafted: int):
        """Runs a round of the session; if the session is preempted, it first queues for the blocks to recompute it
        (ahead of new sessions), then runs the round, which feeds its tokens again."""
        while True:
            tokens = self.service.preempted_tokens(session_id)
            readmitted = (
                self.admission.admitted(self.admission.blocks_needed(tokens + drafted + 1), deadline, resuming=True)
                if tokens and self.admission is not None
                else nullcontext()
            )
            async with readmitted:
                if tokens:
                    self.service.preemptions.readmit(session_id)
                try:
                    return await self._run("step", session_id, *args, follows=follows)
                except SessionPreemptedError:
                    continue

    async def Verify(self, request: verifier_pb2.VerifyRequest, context) -> verifier_pb2.VerifyResponse:
        vocab_size = self.service.model.vocab_size
        drafts = check_token_ids(request.draft_token_ids, vocab_size, "draft_token_ids", allow_empty=True)
        probs = probs_from_proto(request.draft_probs, len(drafts), vocab_size)
        follows = _round_follows(request.next_call) if request.HasField("next_call") else None
        kind = _round_kind(request)
        result = await self._round(
            request.session_id,
            kind,
            request.base_len,
            drafts,
            probs,
            follows=follows,
            deadline=call_deadline(context),
            drafted=len(drafts),
        )
        return _verify_response(*result, self.drain.draining)

    async def VerifyNext(self, request: verifier_pb2.VerifyNextRequest, context) -> verifier_pb2.VerifyNextResponse:
        rounds = [self._guessed_round(guessed, f"rounds[{index}]") for index, guessed in enumerate(request.rounds)]
        follows = _round_follows(request.next_call) if request.HasField("next_call") else None
        choose = self.service.next_round_choice(
            request.session_id, request.after_base_len, rounds, request.plain_otherwise, _round_kind(request)
        )
        try:
            ran = await self._run("step", request.session_id, follows=follows, choose=choose)
        except SessionPreemptedError:  # the caller's plain Verify follows, and queues for the blocks
            ran = None
        if ran is None:
            return verifier_pb2.VerifyNextResponse(ran=False)
        index, result = ran
        return verifier_pb2.VerifyNextResponse(
            ran=True, round_index=index, verdict=_verify_response(*result, self.drain.draining)
        )

    def _guessed_round(self, guessed: verifier_pb2.GuessedRound, field: str) -> GuessedRound:
        vocab_size = self.service.model.vocab_size
        if not guessed.verdict.HasField("next_token_id"):
            raise InvalidFieldError(f"{field}.verdict.next_token_id", "must be set")
        [next_token] = check_token_ids([guessed.verdict.next_token_id], vocab_size, f"{field}.verdict.next_token_id")
        drafts = check_token_ids(guessed.draft_token_ids, vocab_size, f"{field}.draft_token_ids")
        self.service.check_draft_length(drafts, f"{field}.draft_token_ids")
        probs = probs_from_proto(guessed.draft_probs, len(drafts), vocab_size, f"{field}.draft_probs")
        return GuessedRound(guessed.verdict.num_accepted, next_token, drafts, probs)

    async def CallStream(self, request_iterator, context) -> None:
        await self._calls.serve(context)

    async def CloseSession(self, request: common_pb2.CloseSessionRequest, context) -> common_pb2.CloseSessionResponse:
        return common_pb2.CloseSessionResponse(closed=await self._run(self.service.close, request.session_id))

    async def Info(self, request: common_pb2.InfoRequest, context) -> common_pb2.ServiceInfo:
        service, model = self.service, self.service.model
        return common_pb2.ServiceInfo(
            model_id=model.settings.model,
            vocab_size=model.vocab_size,
            tokenizer_sha256=model.identity.tokenizer_sha256,
            device=model.settings.device,
            dtype=model.settings.dtype,
            active_sessions=len(service.sessions),
            kv_cache_tokens=service.sessions.kv_cache_tokens(),
            max_sessions=service.sessions.max_sessions,
            max_context_tokens=model.max_context_tokens,
            tensor_parallel_size=self.tensor_parallel_size,
            step_cost_fixed_ns=service.step_cost.fixed_ns,
            step_cost_per_token_ns=service.step_cost.per_token_ns,
            **kv_block_info(model.kv_pool if model.packed else None),
        )
