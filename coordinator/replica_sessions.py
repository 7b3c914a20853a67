"""One request's sessions on its draft and verify replicas: opened, called with a deadline, moved, closed.

A verify session whose replica is gone, lost it or drains moves to another replica with the committed tokens
(coordinator/session_moves.py). A drafter that fails mid-request (gone, past its deadline, lost the session,
refused) or drains is dropped: the request carries on by plain target decoding through the verifier, which is
still exact, while its draft session moves to another drafter.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
from google.protobuf.message import Message
from opentelemetry.context import Context

from coordinator.close_retry import retry_close_later
from coordinator.generation_state import GenerationState
from coordinator.replica_errors import replica_error
from coordinator.replicas import Replica
from coordinator.session_moves import DRAINING, FAILED, SessionMoves, settle, unavailable_reason
from specdec.common.errors import (
    DownstreamUnavailableError,
    InvalidFieldError,
    ReplicaUnreachableError,
    SpecDecError,
)
from specdec.serving.call_stream_client import CallStreamClient
from specdec.serving.wire import SAMPLING_RULE_ENUMS, constraint_to_proto, sampling_to_proto
from specdec.v1 import common_pb2, drafter_pb2, verifier_pb2

log = logging.getLogger(__name__)
T = TypeVar("T")
FAILED_DRAFTER_CLOSE_TIMEOUT_S = 2.0
VERIFIER = verifier_pb2.DESCRIPTOR.services_by_name["Verifier"]
DRAFTER = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"]


class ReplicaSessions:
    """A request's sessions on one draft and one verify replica, and the calls to them."""

    def __init__(
        self,
        state: GenerationState,
        draft: Replica | None,
        verify: Replica,
        call_timeout_s: float,
        on_draft_unavailable: Callable[[Replica], None] | None = None,
        moves: SessionMoves | None = None,
        deadline: float | None = None,
    ):
        self.state = state
        self.draft = draft if state.plan.gamma > 0 else None  # None once the drafter failed: plain decoding
        self.draft_holding_session = self.draft  # still closed at the end if the drafter fails mid-request
        self._draft_opening = False  # whether its open was sent (after the first token): only then is it closed
        self.verify = verify
        self.timeout = call_timeout_s
        self.on_draft_unavailable = on_draft_unavailable  # e.g. take the replica out of placement
        self.moves = moves  # None: sessions stay where they opened
        self.deadline = deadline  # the client's, on the event loop's clock: opens may queue for KV blocks until it
        self._verify_draining: Replica | None = None  # the verify replica that said it drains
        self._verify_move = asyncio.Lock()  # one move at a time: calls failing together move once
        self.verify_epoch = 0  # counts moves of the verify session begun and ended: a chained round sent before or
        # during one is void (it ran, if at all, on the replica left behind)
        self._draft_move: asyncio.Future | None = None  # the draft session's move in flight
        self._opens: asyncio.Future | None = None  # once opening: -> the opens' outcomes
        self._streams: dict[tuple[str, str], CallStreamClient] = {}  # by (kind, replica address): its call streams
        # Until the first token is committed, a verify open (a move's too) draws it from its prefill, with this hint
        # of whether the first round follows at once; after that a move's open must not: the tokens it reopens on
        # already hold it.
        self._first_token_hint: verifier_pb2.NextCallHint | None = None
        self._verify_opened: verifier_pb2.OpenVerifySessionResponse | None = None  # the last verify open's answer

    async def open(self) -> verifier_pb2.OpenVerifySessionResponse:
        """Opens the verify session (prefilling the prompt) and returns its answer, with the first token it drew from
        its prefill (as plain decoding's first step draws it). The drafter's session opens after that token is out
        (`drafter_opened`): the client sees the first token without waiting for a draft, nor sharing a host with one.
        A verify replica that is gone or drains passes the session to another one, which draws the token."""
        state, plan = self.state, self.state.plan
        started = time.perf_counter_ns()
        # the first round follows the first token at once when it is plain; a speculative one drafts first
        self._first_token_hint = verifier_pb2.NextCallHint(
            after_any_verdict=self.draft is None and plan.max_new_tokens > 1
        )
        with state.telemetry.stage("open_sessions") as parent:
            verify_open = asyncio.ensure_future(self._open_verify(parent))
            self._opens = asyncio.gather(verify_open, return_exceptions=True)
            try:
                reply = await asyncio.shield(verify_open)
            except BaseException:  # failed or cancelled: no close may overtake an open still in flight
                await asyncio.wait([self._opens])
                raise
            finally:
                self._first_token_hint = None  # committed by the caller, or the request failed
        state.stats.prefill_ns = time.perf_counter_ns() - started
        state.metrics.stage_ns(prefill=state.stats.prefill_ns)
        return reply

    async def drafter_opened(self) -> None:
        """Opens the draft session on every committed token (the first one included) when speculating, and waits for
        it (a drafter that fails it turns the request plain); raises what the request itself got wrong there."""
        if self.draft is None:
            return
        self.state.lanes_on_committed()
        self._draft_opening = True
        with self.state.telemetry.stage("open_draft_session") as parent:
            draft_open = asyncio.ensure_future(self.without_draft_on_failure(self._open(self.draft, "draft", parent)))
            self._opens = asyncio.gather(self._opens, draft_open, return_exceptions=True)
            [_, outcome] = await _settled(self._opens)
        if isinstance(outcome, BaseException):
            raise outcome

    async def _open_verify(self, parent: Context) -> verifier_pb2.OpenVerifySessionResponse:
        try:
            return await self._open(self.verify, "verify", parent)
        except DownstreamUnavailableError as error:
            if not await self.move_verify(self.verify, unavailable_reason(error)):
                raise
            return self._verify_opened  # the open on the replica it moved to, which drew the first token

    def _open_request(self, lane: str):
        """The OpenSession request of the verify or draft session, on every token committed so far (the output, which
        the constraint and the penalties cover, still begins where the request's does); a verify open before the
        first token is committed draws it."""
        plan = self.state.plan
        tokens = list(self.state.committed)
        fields = dict(
            session_id=plan.request_id,
            prompt_token_ids=tokens,
            sampling=sampling_to_proto(plan.params),
            sampling_rule=SAMPLING_RULE_ENUMS[plan.params.rule],
            constraint=constraint_to_proto(plan.constraint),
            output_start=plan.output_start or len(plan.prompt_ids),
        )
        if lane == "verify":
            first = self._first_token_hint
            return verifier_pb2.OpenVerifySessionRequest(
                **fields,
                logprobs=plan.top_logprobs is not None,
                top_logprobs=plan.top_logprobs or 0,
                draw_first_token=first is not None,
                next_call=first,
            )
        return drafter_pb2.OpenDraftSessionRequest(
            **fields, draft_method=plan.draft_method, num_lanes=len(self.state.lanes)
        )

    async def _open(self, replica: Replica, lane: str, parent: Context | None = None) -> Message:
        with self.state.telemetry.remote_call(f"{lane}.open_session", parent) as call:
            left = self.deadline - asyncio.get_running_loop().time() if self.deadline is not None else self.timeout
            reply = await self.call(replica, "OpenSession", self._open_request(lane), max(left, 0.0), lane)
            call.inside(f"{lane}.prefill", lane, reply.prefill_ns)
        if lane == "verify":
            self._verify_opened = reply
        return reply

    async def close(self) -> None:
        """Closes the sessions on both replicas, the drafter's too after a fallback (it may be back, or only
        slow): there with a short deadline, since it already failed once."""
        if self._opens is not None:
            await asyncio.wait([self._opens])  # a close must reach each replica after its open
        await settle(self._draft_move)
        for stream in self._streams.values():  # ends the calls still held there (a follow-up no verdict selected)
            stream.cancel()
        telemetry = self.state.telemetry
        request = common_pb2.CloseSessionRequest(session_id=self.state.plan.request_id)
        replicas = [
            (r, lane)
            for r, lane in (
                (self.verify, "verify"),
                (self.draft_holding_session if self._draft_opening else None, "draft"),
            )
            if r is not None
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
        """Runs a drafter call; if the drafter fails (gone, past its deadline, lost the session, refused), the request
        carries on by plain target decoding through the verifier, which is still exact, while its draft session moves
        to another drafter. None on failure."""
        draft = self.draft
        try:
            return await call
        except InvalidFieldError:
            raise  # the request itself is wrong (e.g. a draft method this drafter does not serve)
        except (SpecDecError, grpc.aio.AioRpcError) as error:  # gone, lost the session, refused a call
            if self.draft is draft and draft is not None:
                log.warning(
                    "request %s: drafter %s failed (%s); decoding plainly%s",
                    self.state.plan.request_id,
                    draft.address,
                    error,
                    " while the session moves" if self.moves is not None else "",
                )
                self.state.stats.draft_fallbacks += 1
                if isinstance(error, ReplicaUnreachableError) and self.on_draft_unavailable is not None:
                    self.on_draft_unavailable(draft)
                reason = unavailable_reason(error) if isinstance(error, DownstreamUnavailableError) else FAILED
                self.leave_drafter(draft, reason)
            return None

    def leave_drafter(self, draft: Replica, reason: str) -> None:
        """Stops drafting on `draft` (it failed or drains) and moves the draft session to another drafter in the
        background; rounds are plain meanwhile, and for good if none takes it."""
        if self.draft is not draft:
            return
        self.draft = None
        if self.moves is not None and self._draft_move is None:
            self._draft_move = asyncio.ensure_future(self._move_draft(draft, reason))

    async def _move_draft(self, leaving: Replica, reason: str) -> None:
        try:
            arrived = await self.moves.move("draft", leaving, reason, lambda replica: self._open(replica, "draft"))
        except (SpecDecError, grpc.aio.AioRpcError) as error:
            log.warning("request %s: moving its draft session failed (%s)", self.state.plan.request_id, error)
            return
        finally:
            self._draft_move = None
        if arrived is not None:  # its lanes hold the committed tokens, which every later call syncs from
            self.state.lanes_on_committed()
            self._end_stream("draft", leaving)
            self.draft = self.draft_holding_session = arrived

    async def call_verify(self, method: str, request):
        """A call on the verify session; when its replica is gone or lost the session, the session moves to another
        replica and the call runs again there (its base_len is the committed length the new session opens at)."""
        while True:
            replica = self.verify
            try:
                return await self.call(replica, method, request)
            except DownstreamUnavailableError as error:
                if not await self.move_verify(replica, unavailable_reason(error)):
                    raise

    def verify_drains(self, replica: Replica) -> None:
        """A reply said the verify replica drains: the session moves before its next round."""
        self._verify_draining = replica

    async def leave_draining_verifier(self) -> bool:
        """Moves the verify session off a replica that said it drains; whether it moved."""
        draining = self._verify_draining
        if draining is None or draining is not self.verify:
            return False
        self._verify_draining = None
        return await self.move_verify(draining, DRAINING)

    async def move_verify(self, leaving: Replica, reason: str) -> bool:
        """Moves the verify session off `leaving` (unless a call failing beside this one already did); whether the
        session is elsewhere now."""
        if self.moves is None:
            return False
        async with self._verify_move:
            if self.verify is not leaving:
                return True
            self.verify_epoch += 1  # and again when it ends: a chained round sent meanwhile went to `leaving`
            try:
                arrived = await self.moves.move(
                    "verify", leaving, reason, lambda replica: self._open(replica, "verify")
                )
            finally:
                self.verify_epoch += 1
            if arrived is None:
                return False
            self.verify = arrived
            self._end_stream("verify", leaving)
            return True

    def _call_stream(self, replica: Replica, kind: str) -> CallStreamClient:
        """The session's call stream to the `kind` service of `replica`, opened by its first call."""
        stream = self._streams.get((kind, replica.address))
        if stream is None:
            service = VERIFIER if kind == "verify" else DRAFTER
            stream = self._streams[kind, replica.address] = CallStreamClient(replica.stub.CallStream, service)
        return stream

    def _end_stream(self, kind: str, replica: Replica) -> None:
        """Ends the session's call stream to a replica it left, so a draining one need not wait for it to exit."""
        stream = self._streams.pop((kind, replica.address), None)
        if stream is not None:
            stream.cancel()

    async def call(self, replica: Replica, method: str, request, timeout: float | None = None, kind: str = ""):
        """One internal call with a deadline (`timeout`, else the call timeout) on a `kind` replica (default: the
        verify replica's kind if it is that one); a failure becomes the error that blames the right party
        (coordinator/replica_errors.py)."""
        kind = kind or ("verify" if replica is self.verify else "draft")
        timeout = self.timeout if timeout is None else timeout
        try:
            if self.state.plan.call_streams:
                return await self._call_stream(replica, kind).call(method, request, timeout)
            return await getattr(replica.stub, method)(request, timeout=timeout)
        except grpc.aio.AioRpcError as error:
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
