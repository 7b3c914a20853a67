"""A session's call stream from the caller's side: unary calls sent as messages on one stream (CallStream).

`CallStreamClient.call` behaves as the unary call would: it returns the method's response, or raises
grpc.aio.AioRpcError with the status the method ended with, DEADLINE_EXCEEDED past its timeout, and UNAVAILABLE when
the stream breaks (the replica is gone). Calls run concurrently; each reply finds its call by id. A stream that
ended is opened anew by the next call. The session's end cancels the stream. The server's half is
specdec/serving/call_stream.py.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from opentelemetry import propagate

from specdec.v1 import common_pb2

STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}
OpenStream = Callable[[], grpc.aio.StreamStreamCall]  # e.g. stub.CallStream


class CallStreamClient:
    """One stream of calls to one replica's service (`service`, whose CallStream `open_stream` opens)."""

    def __init__(self, open_stream: OpenStream, service: ServiceDescriptor):
        self._open_stream = open_stream
        self._service = service
        self._responses = {method.name: GetMessageClass(method.output_type) for method in service.methods}
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}  # the current stream's calls awaiting replies
        self._stream: grpc.aio.StreamStreamCall | None = None
        self._reader: asyncio.Task | None = None
        self._writing = asyncio.Lock()  # one write at a time on a stream

    async def call(self, method: str, request: Message, timeout: float) -> Message:
        """Calls `method` (its name in the service, e.g. "Verify") with `request`, as a unary call would."""
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        call = common_pb2.StreamedCall(
            call_id=next(self._ids),
            method=f"/{self._service.full_name}/{method}",
            request=request.SerializeToString(),
            traceparent=carrier.get("traceparent", ""),
            timeout_s=timeout,
        )
        reply = asyncio.get_running_loop().create_future()
        pending: dict[int, asyncio.Future] = {}
        try:
            async with asyncio.timeout(timeout):
                pending = await self._write(call, reply)
                answer: common_pb2.StreamedReply = await reply
        except TimeoutError:
            deadline = f"{method}: no reply within {timeout}s"
            raise grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, details=deadline) from None
        finally:
            pending.pop(call.call_id, None)
        if answer.status_code:
            code = STATUS_CODES.get(answer.status_code, grpc.StatusCode.UNKNOWN)
            raise grpc.aio.AioRpcError(code, details=answer.status_details)
        return self._responses[method].FromString(answer.response)

    async def _write(self, call: common_pb2.StreamedCall, reply: asyncio.Future) -> dict[int, asyncio.Future]:
        """Sends the call on the stream (opened anew when the last one ended), its reply awaited by `reply`; returns
        the stream's calls awaiting replies, which hold it."""
        async with self._writing:
            if self._stream is None or self._stream.done():
                self._stream, self._pending = self._open_stream(), {}
                self._reader = asyncio.ensure_future(self._read(self._stream, self._pending))
            pending = self._pending
            pending[call.call_id] = reply
            try:
                await self._stream.write(call)
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as error:
                pending.pop(call.call_id, None)
                raise _unavailable(f"the call stream ended: {error}") from error
            return pending

    async def _read(self, stream: grpc.aio.StreamStreamCall, pending: dict[int, asyncio.Future]) -> None:
        """Hands each reply of `stream` to its call; when the stream ends, its calls still waiting fail UNAVAILABLE."""
        ended = "the call stream ended"
        try:
            async for answer in stream:
                waiting = pending.get(answer.call_id)
                if waiting is not None and not waiting.done():
                    waiting.set_result(answer)
        except grpc.aio.AioRpcError as error:
            ended = f"the call stream ended: {error.code().name}: {error.details()}"
        finally:
            for waiting in pending.values():
                if not waiting.done():
                    waiting.set_exception(_unavailable(ended))

    def cancel(self) -> None:
        """Ends the stream at once, when the session is done: the server cancels the calls it still holds."""
        if self._stream is not None:
            self._stream.cancel()


def _unavailable(details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, details=details)
