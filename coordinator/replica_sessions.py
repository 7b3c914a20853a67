"""One request's sessions on its draft and verify replicas: opened, called with a deadline, closed.

A drafter that fails mid-request (gone, past its deadline, lost the session) is dropped: the request carries on
by plain target decoding through the verifier, which is still exact.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
from opentelemetry.context import Context

from coordinator.close_retry import retry_close_later
from coordinator.generation_state import GenerationState
from coordinator.replica_errors import replica_error
from coordinator.replicas import Replica
from specdec.common.errors import InvalidFieldError, ReplicaUnreachableError, SpecDecError
from specdec.serving.wire import SAMPLING_RULE_ENUMS, constraint_to_proto, sampling_to_proto
from specdec.v1 import common_pb2, drafter_pb2, verifier_pb2

log = logging.getLogger(__name__)
T = TypeVar("T")
FAILED_DRAFTER_CLOSE_TIMEOUT_S = 2.0


class ReplicaSessions:
    """A request's sessions on one draft and one verify replica, and the calls to them."""

    def __init__(
        self,
        state: GenerationState,
        draft: Replica | None,
        verify: Replica,
        call_timeout_s: float,
        on_draft_unavailable: Callable[[Replica], None] | None = None,
    ):
        self.state = state
        self.draft = draft if state.plan.gamma > 0 else None  # None once the drafter failed: plain decoding
        self._draft_holding_session = self.draft  # still closed at the end if the drafter fails mid-request
        self.verify = verify
        self.timeout = call_timeout_s
        self.on_draft_unavailable = on_draft_unavailable  # e.g. take the replica out of placement

    async def open(self) -> None:
        """Opens the session on both replicas (prefilling the prompt), the drafter's only if speculating."""
        state, plan = self.state, self.state.plan
        started = time.perf_counter_ns()
        sampling, rule = sampling_to_proto(plan.params), SAMPLING_RULE_ENUMS[plan.params.rule]
        constraint = constraint_to_proto(plan.constraint)
        with state.telemetry.stage("open_sessions") as parent:
            calls = [
                self._open(
                    self.verify,
                    "verify",
                    parent,
                    verifier_pb2.OpenVerifySessionRequest(
                        session_id=plan.request_id,
                        prompt_token_ids=plan.prompt_ids,
                        sampling=sampling,
                        sampling_rule=rule,
                        logprobs=plan.top_logprobs is not None,
                        top_logprobs=plan.top_logprobs or 0,
                        constraint=constraint,
                        output_start=plan.output_start,
                    ),
                )
            ]
            if self.draft is not None:
                calls.append(
                    self.without_draft_on_failure(
                        self._open(
                            self.draft,
                            "draft",
                            parent,
                            drafter_pb2.OpenDraftSessionRequest(
                                session_id=plan.request_id,
                                prompt_token_ids=plan.prompt_ids,
                                sampling=sampling,
                                draft_method=plan.draft_method,
                                num_lanes=len(state.lanes),
                                sampling_rule=rule,
                                constraint=constraint,
                                output_start=plan.output_start,
                            ),
                        )
                    )
                )
            for outcome in await _settled(asyncio.gather(*calls, return_exceptions=True)):
                if isinstance(outcome, BaseException):
                    raise outcome
        state.stats.prefill_ns = time.perf_counter_ns() - started
        state.metrics.stage_ns(prefill=state.stats.prefill_ns)

    async def _open(self, replica: Replica, lane: str, parent: Context, request) -> None:
        with self.state.telemetry.remote_call(f"{lane}.open_session", parent) as call:
            reply = await self.call(replica, "OpenSession", request)
            call.inside(f"{lane}.prefill", lane, reply.prefill_ns)

    async def close(self) -> None:
        """Closes the sessions on both replicas, the drafter's too after a fallback (it may be back, or only
        slow): there with a short deadline, since it already failed once."""
        telemetry = self.state.telemetry
        request = common_pb2.CloseSessionRequest(session_id=self.state.plan.request_id)
        replicas = [
            (r, lane) for r, lane in ((self.verify, "verify"), (self._draft_holding_session, "draft")) if r is not None
        ]

        async def close(replica: Replica, lane: str, parent: Context) -> None:
            failed_drafter = lane == "draft" and self.draft is None
            with telemetry.remote_call(f"{lane}.close_session", parent):
                await replica.stub.CloseSession(
                    request,
                    timeout=min(self.timeout, FAILED_DRAFTER_CLOSE_TIMEOUT_S) if failed_drafter else self.timeout,
                )

        with telemetry.stage("close_sessions") as parent:
            results = await asyncio.gather(*(close(r, lane, parent) for r, lane in replicas), return_exceptions=True)
        for (replica, _), result in zip(replicas, results):
            if isinstance(result, Exception):
                log.warning(
                    "request %s: closing its session on %s failed: %s; retrying once in the background",
                    self.state.plan.request_id,
                    replica.address,
                    result,
                )
                retry_close_later(replica, self.state.plan.request_id, self.timeout)

    async def without_draft_on_failure(self, call: Awaitable[T]) -> T | None:
        """Runs a drafter call; if the drafter fails (gone, past its deadline, lost the session), the request
        carries on by plain target decoding through the verifier, which is still exact. None on failure."""
        draft = self.draft
        try:
            return await call
        except InvalidFieldError:
            raise  # the request itself is wrong (e.g. a draft method this drafter does not serve)
        except (SpecDecError, grpc.aio.AioRpcError) as error:  # gone, lost the session, refused a call
            if self.draft is draft and draft is not None:
                log.warning(
                    "request %s: drafter %s failed (%s); finishing by plain decoding",
                    self.state.plan.request_id,
                    draft.address,
                    error,
                )
                self.draft = None
                self.state.stats.draft_fallbacks += 1
                if isinstance(error, ReplicaUnreachableError) and self.on_draft_unavailable is not None:
                    self.on_draft_unavailable(draft)
            return None

    async def call(self, replica: Replica, method: str, request):
        """One internal call with a deadline; a failure becomes the error that blames the right party
        (coordinator/replica_errors.py)."""
        try:
            return await getattr(replica.stub, method)(request, timeout=self.timeout)
        except grpc.aio.AioRpcError as error:
            kind = "verify" if replica is self.verify else "draft"
            raise replica_error(kind, replica.address, method, self.state.plan.request_id, error) from error


async def _settled(opens: asyncio.Future[list]) -> list:
    """The opens' outcomes once every open has answered, even when the request is cancelled meanwhile.

    - The close that follows must reach each replica after its open: an open cancelled in flight may still arrive
      there after the close, find nothing to close before it, and leave its session open.
    - A cancelled request therefore waits for its opens (each within the call deadline), then is cancelled.
    """
    try:
        return await asyncio.shield(opens)
    except asyncio.CancelledError:
        await asyncio.wait([opens])
        raise
