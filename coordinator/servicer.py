"""The Coordinator gRPC servicer: validates, places the request on replicas, runs it, streams chunks."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

from transformers import PreTrainedTokenizerBase

from coordinator.constraint_check import ConstraintCheck
from coordinator.generation import Generation
from coordinator.read_ahead import read_ahead
from coordinator.replicas import ReplicaPool
from coordinator.request_guard import GuardedRequest, RequestGuard
from coordinator.request_plan import GenerationPlan
from coordinator.request_stats import RequestStats
from coordinator.request_telemetry import RequestTelemetry
from coordinator.session_moves import Placement
from coordinator.settings import CoordinatorSettings
from coordinator.speculation_gate import SpeculationGate
from coordinator.speculation_policy import AcceptanceRate, RoundTimes
from coordinator.validation import plan_request
from specdec.common.errors import ReplicaUnreachableError
from specdec.sampling.constraints import ConstraintCompiler
from specdec.serving.wire import SAMPLING_RULE_ENUMS, call_deadline
from specdec.telemetry.metrics import speculation_metrics
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc

log = logging.getLogger(__name__)

FINISH_REASONS = {
    None: coordinator_pb2.FINISH_REASON_UNSPECIFIED,
    "length": coordinator_pb2.FINISH_REASON_LENGTH,
    "stop": coordinator_pb2.FINISH_REASON_STOP,
    "eos": coordinator_pb2.FINISH_REASON_EOS,
    "constraint_dead_end": coordinator_pb2.FINISH_REASON_CONSTRAINT_DEAD_END,
}


def stats_to_proto(stats: RequestStats, plan: GenerationPlan) -> coordinator_pb2.GenerationStats:
    return coordinator_pb2.GenerationStats(
        rounds=stats.rounds,
        drafted_tokens=stats.drafted,
        accepted_tokens=stats.accepted,
        acceptance_rate=stats.acceptance_rate,
        mean_accepted_length=stats.mean_accepted_length,
        accepted_per_position=stats.accepted_per_position,
        drafted_per_position=stats.drafted_per_position,
        draft_ns=stats.draft_ns,
        verify_ns=stats.verify_ns,
        sampling_ns=stats.sampling_ns,
        wire_ns=max(0, stats.wire_ns),
        prefill_ns=stats.prefill_ns,
        total_ns=stats.total_ns,
        predraft_attempts=stats.predraft_attempts,
        predraft_hits=stats.predraft_hits,
        predraft_guesses=stats.predraft_guesses,
        chained_rounds=stats.chained_rounds,
        wire_bytes=stats.wire_bytes,
        sampling_rule=SAMPLING_RULE_ENUMS[plan.params.rule],
        seed=plan.params.seed,
        prompt_tokens=len(plan.prompt_ids),
        verify_session_moves=stats.verify_moves,
        draft_session_moves=stats.draft_moves,
    )


def add_chunk(response: coordinator_pb2.GenerateResponse, reply: coordinator_pb2.GenerateStreamResponse) -> None:
    """Adds one streamed chunk to a whole response."""
    response.text += reply.text
    response.token_ids.extend(reply.token_ids)
    response.logprobs.extend(reply.logprobs)
    response.request_id = reply.request_id
    response.finish_reason = reply.finish_reason
    if reply.HasField("stats"):
        response.stats.CopyFrom(reply.stats)


def _publish_gate_throughput(level: int, speculative: bool, tokens_per_s: float) -> None:
    speculation_metrics().gate_throughput.labels(str(level), "speculative" if speculative else "plain").set(
        tokens_per_s
    )


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    """Thin shell: every request becomes a Generation on the least-loaded draft and verify replicas."""

    def __init__(
        self,
        settings: CoordinatorSettings,
        tokenizer: PreTrainedTokenizerBase,
        eos_token_ids: set[int],
        vocab_size: int,
        draft_pool: ReplicaPool,
        verify_pool: ReplicaPool,
        guard: RequestGuard | None = None,
    ):
        self.settings = settings
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.draft_pool = draft_pool
        self.verify_pool = verify_pool
        self.constraints = ConstraintCheck(
            ConstraintCompiler(tokenizer, vocab_size, eos_token_ids, settings.constraint_limits())
        )
        self.guard = guard or RequestGuard(settings)  # limits; with Redis also rate limits, journal, leases
        self.acceptance = AcceptanceRate() if settings.adaptive_gamma else None  # None: every round uses plan.gamma
        self.round_times = RoundTimes() if settings.adaptive_gamma else None
        self.placement = Placement(draft_pool, verify_pool, settings.max_session_moves)
        self.gate = (
            SpeculationGate(on_measured=_publish_gate_throughput)
            if settings.adaptive_gamma and settings.speculation_gate
            else None
        )

    async def _run(
        self, request: coordinator_pb2.GenerateRequest, deadline: float | None = None
    ) -> AsyncIterator[coordinator_pb2.GenerateStreamResponse]:
        telemetry = RequestTelemetry()  # TTFT counts from here
        plan = plan_request(request, self.settings, self.tokenizer, self.vocab_size)
        if plan.constraint is not None:  # an invalid one fails here, before it takes a session anywhere
            await self.constraints.check(plan.constraint)
        async with self.guard.admit(request, plan) as guarded:  # coordinator/request_guard.py
            # the rounds run ahead of the journal and client writes of their chunks (coordinator/read_ahead.py)
            replies = guarded.replies(read_ahead(self._generate(request, guarded, telemetry, deadline)))
            async with contextlib.aclosing(replies):
                async for reply in replies:
                    yield reply

    async def _generate(
        self,
        request: coordinator_pb2.GenerateRequest,
        guarded: GuardedRequest,
        telemetry: RequestTelemetry,
        deadline: float | None,
    ) -> AsyncIterator[coordinator_pb2.GenerateStreamResponse]:
        plan = guarded.plan  # a resumed request runs the rest of its budget after its journaled tokens
        text = guarded.text_stream(self.tokenizer, self.eos_token_ids, request.stop)
        verify = self.verify_pool.acquire()
        draft = self.draft_pool.acquire(required=False) if plan.gamma > 0 else None  # none healthy: plain decoding
        generation = Generation(
            plan,
            draft,
            verify,
            text,
            self.settings.call_timeout_s,
            telemetry,
            on_draft_unavailable=self.draft_pool.mark_unhealthy,
            acceptance=self.acceptance,
            round_times=self.round_times,
            gate=self.gate,
            placement=self.placement,
            deadline=deadline,
        )
        try:
            async with contextlib.aclosing(generation.chunks()) as chunks:  # closes the sessions as soon as it ends
                async for chunk in chunks:
                    reply = coordinator_pb2.GenerateStreamResponse(
                        text=chunk.text,
                        token_ids=chunk.token_ids,
                        finish_reason=FINISH_REASONS[chunk.finish_reason],
                        request_id=plan.request_id,
                        logprobs=chunk.logprobs,
                    )
                    if chunk.finish_reason and request.include_stats:
                        generation.stats.total_ns = generation.elapsed_ns()
                        reply.stats.CopyFrom(stats_to_proto(generation.stats, plan))
                    yield reply
        except ReplicaUnreachableError as error:
            verify = generation.sessions.verify
            if error.address == verify.address:  # out of placement until its health check says SERVING
                self.verify_pool.mark_unhealthy(verify)
            raise
        finally:  # the replicas it ends on (its sessions may have moved: coordinator/session_moves.py)
            self.verify_pool.release(generation.sessions.verify)
            if generation.sessions.draft_holding_session is not None:
                self.draft_pool.release(generation.sessions.draft_holding_session)
        log.info(
            "request %s: %d prompt + %d new tokens, %d rounds, α=%.2f, finish=%s",
            plan.request_id,
            len(plan.prompt_ids),
            len(text.token_ids),
            generation.stats.rounds,
            generation.stats.acceptance_rate,
            text.finish_reason,
        )

    async def GenerateStream(self, request, context) -> AsyncIterator[coordinator_pb2.GenerateStreamResponse]:
        async with contextlib.aclosing(self._run(request, call_deadline(context))) as replies:  # cleans up at once
            async for reply in replies:
                yield reply

    async def Generate(self, request, context) -> coordinator_pb2.GenerateResponse:
        response = coordinator_pb2.GenerateResponse()
        async with contextlib.aclosing(self._run(request, call_deadline(context))) as replies:
            async for reply in replies:
                add_chunk(response, reply)
        return response

    async def Info(self, request, context) -> coordinator_pb2.CoordinatorInfo:
        settings = self.settings
        return coordinator_pb2.CoordinatorInfo(
            target_model_id=settings.tokenizer,
            draft_replicas=[r.address for r in self.draft_pool.replicas],
            verify_replicas=[r.address for r in self.verify_pool.replicas],
            default_num_speculative_tokens=settings.default_num_speculative_tokens,
            max_num_speculative_tokens=settings.max_num_speculative_tokens,
            max_new_tokens_limit=settings.max_new_tokens_limit,
            max_context_tokens=settings.max_context_tokens,
            overlap=settings.overlap,
        )
