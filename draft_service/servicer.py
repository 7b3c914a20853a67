"""The Drafter gRPC servicer: decodes requests, queues them for DraftService's model thread, encodes replies.

Opens and Propose calls that arrive while a step runs are batched into the next step (specdec/engine/step_batcher.py);
Propose calls join a running propose step before its next pass (--join-running-step).
A session's calls may also come as messages on its call stream (CallStream, specdec/serving/call_stream.py), each
answered by the same method as its unary call.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import nullcontext

from draft_service.service import MODEL, NGRAM, DraftService, LaneProposal, ProposeResult
from specdec.engine.kv.admission import KVAdmission, WaitHook
from specdec.engine.step_batcher import StepBatcher
from specdec.serving.call_stream import CallStreamServer, streamed_methods
from specdec.serving.drain import SessionDrain
from specdec.serving.session_store import expire_idle_sessions
from specdec.serving.wire import (
    call_deadline,
    check_token_ids,
    constraint_from_proto,
    kv_block_info,
    probs_to_proto,
    session_sampling_from_proto,
)
from specdec.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc

METHOD_NAMES = {
    common_pb2.DRAFT_METHOD_UNSPECIFIED: None,
    common_pb2.DRAFT_METHOD_MODEL: MODEL,
    common_pb2.DRAFT_METHOD_NGRAM: NGRAM,
}
METHOD_ENUMS = {MODEL: common_pb2.DRAFT_METHOD_MODEL, NGRAM: common_pb2.DRAFT_METHOD_NGRAM}


def _after_a_verification(result: object) -> bool:
    """A session's next Propose follows the verification of what it drafted: never at once, so the model
    thread does not hold a step back for it (specdec/engine/step_batcher.py)."""
    return False


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    """Thin shell over DraftService; model work runs on one batching worker thread so the event loop stays free."""

    def __init__(
        self,
        service: DraftService,
        on_step: Callable[[str, int], None] | None = None,
        on_queue_wait: WaitHook | None = None,
    ):
        self.service = service
        joining = {"propose": service.propose_joining} if service.settings.join_running_step else {}
        self._batcher = StepBatcher(
            {"open": service.open_many, "propose": service.propose_many},
            service.settings.max_batch_size,
            "draft-model",
            on_step,
            service.settings.max_batch_wait_ms / 1000,
            joining_fns=joining,
            thread_cpus=service.settings.model_thread_cpus(),
        )
        self._calls = CallStreamServer(streamed_methods(self, drafter_pb2.DESCRIPTOR.services_by_name["Drafter"]))
        model = service.model
        queue_limit = service.settings.kv_queue_limit
        packed = model is not None and model.packed
        self.admission = KVAdmission(model.kv_pool, queue_limit, on_queue_wait) if packed else None
        self.drain = SessionDrain(service.sessions)

    def close(self) -> None:
        """Ends the model thread once the server has stopped."""
        self._batcher.close()

    async def expire_idle_sessions(self) -> None:
        """Runs until cancelled: closes sessions idle past --session-idle-ttl-s (specdec/serving/session_store.py)."""
        service = self.service
        await expire_idle_sessions(
            service.sessions, service.settings.session_idle_ttl_s, service.close, self._batcher.run
        )

    async def OpenSession(
        self, request: drafter_pb2.OpenDraftSessionRequest, context
    ) -> drafter_pb2.OpenDraftSessionResponse:
        prompt = check_token_ids(request.prompt_token_ids, self.service.vocab_size, "prompt_token_ids")
        params = session_sampling_from_proto(request.sampling, request.sampling_rule)
        method = METHOD_NAMES.get(request.draft_method, "unknown")
        lanes = max(request.num_lanes, 1)
        self.drain.refuse_if_draining()
        constraint = constraint_from_proto(request.constraint)
        if constraint is not None and self.service.constraints is not None:  # off the model thread, as the verifier
            await asyncio.to_thread(self.service.constraints.compile, constraint)
        admission = self.admission
        holds_kv = admission is not None and (method or self.service.settings.default_draft_method) == MODEL
        admitted = (
            admission.admitted(
                admission.blocks_needed(len(prompt), lanes),
                call_deadline(context),
                max_wait_s=self.service.settings.kv_admission_wait_ms / 1000,
            )
            if holds_kv
            else nullcontext()
        )
        async with admitted:
            prefill_ns = await self._batcher.submit(
                "open", request.session_id, prompt, params, method, lanes, constraint, request.output_start
            )
        return drafter_pb2.OpenDraftSessionResponse(session_len=len(prompt), prefill_ns=prefill_ns)

    async def Propose(self, request: drafter_pb2.ProposeRequest, context) -> drafter_pb2.ProposeResponse:
        proposal = self._lane_proposal(0, request, committed_len=request.base_len)  # a Propose's base is committed
        results = await self._batcher.submit("propose", request.session_id, [proposal], follows=_after_a_verification)
        return _propose_response(results[0], self.drain.draining)

    async def ProposeLanes(self, request: drafter_pb2.ProposeLanesRequest, context) -> drafter_pb2.ProposeLanesResponse:
        proposals = [self._lane_proposal(lane.lane, lane, request.committed_len) for lane in request.lanes]
        results = await self._batcher.submit("propose", request.session_id, proposals, follows=_after_a_verification)
        return drafter_pb2.ProposeLanesResponse(
            lanes=[_propose_response(result) for result in results], draining=self.drain.draining
        )

    def _lane_proposal(
        self, lane: int, request: drafter_pb2.ProposeRequest | drafter_pb2.LaneProposal, committed_len: int
    ) -> LaneProposal:
        appended = check_token_ids(
            request.appended_token_ids, self.service.vocab_size, "appended_token_ids", allow_empty=True
        )
        return LaneProposal(
            lane,
            request.base_len,
            appended,
            request.num_speculative_tokens,
            request.num_alternatives,
            request.num_lookup_tokens,
            request.num_forced_tokens,
            committed_len,
        )

    async def CallStream(self, request_iterator, context) -> None:
        await self._calls.serve(context)

    async def CloseSession(self, request: common_pb2.CloseSessionRequest, context) -> common_pb2.CloseSessionResponse:
        return common_pb2.CloseSessionResponse(closed=await self._batcher.run(self.service.close, request.session_id))

    async def Info(self, request: common_pb2.InfoRequest, context) -> common_pb2.ServiceInfo:
        service, model = self.service, self.service.model
        return common_pb2.ServiceInfo(
            model_id=model.settings.model if model else NGRAM,
            vocab_size=service.vocab_size,
            tokenizer_sha256=model.identity.tokenizer_sha256 if model else "",
            device=model.settings.device if model else "cpu",
            dtype=model.settings.dtype if model else "",
            active_sessions=len(service.sessions),
            kv_cache_tokens=service.sessions.kv_cache_tokens(),
            max_sessions=service.sessions.max_sessions,
            max_context_tokens=model.max_context_tokens if model else 0,
            tensor_parallel_size=1,
            draft_methods=[METHOD_ENUMS[m] for m in service.methods],
            step_cost_fixed_ns=service.step_cost.fixed_ns if service.step_cost else 0.0,
            step_cost_per_token_ns=service.step_cost.per_token_ns if service.step_cost else 0.0,
            **kv_block_info(model.kv_pool if model and model.packed else None),
        )


def padded_rows(alternatives: list[list[int]]) -> list[int]:
    """Per position alternatives, row-major at the widest row's width, shorter rows padded with -1."""
    width = max(map(len, alternatives), default=0)
    return [token for position in alternatives for token in [*position, *[-1] * (width - len(position))]]


def _propose_response(result: ProposeResult, draining: bool = False) -> drafter_pb2.ProposeResponse:
    proposal = result.proposal
    return drafter_pb2.ProposeResponse(
        draft_token_ids=proposal.token_ids,
        draft_probs=probs_to_proto(proposal.probs),
        session_len=result.session_len,
        draft_ns=result.draft_ns,
        batch_rows=result.batch_rows,
        alternative_token_ids=padded_rows(proposal.alternatives),
        draining=draining,
    )
