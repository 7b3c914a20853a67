"""Serving a session's call stream: the unary methods of a service, called as messages on one long-lived stream.

A unary call costs both sides a call's setup: its own HTTP/2 stream, metadata, the interceptors, a handler task. A
request's rounds make a few calls each, so where a model step takes a few milliseconds that is a large part of a
round (docs/architecture.md, "The serving path's cost per round"). The coordinator therefore opens one stream per
session on each replica (`CallStream`) and sends each call as a StreamedCall on it; here every call runs as its
unary method would (concurrently with the others, through the same servicer method), and its StreamedReply carries
the status the method ended with, mapped as the error interceptor maps it (specdec/serving/grpc_errors.py), with the
same server span and RPC metrics (specdec/serving/grpc_telemetry.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError, Message
from google.protobuf.message_factory import GetMessageClass

from specdec.common.errors import InvalidFieldError
from specdec.serving.grpc_errors import logged_status
from specdec.serving.grpc_telemetry import ServerTelemetryInterceptor
from specdec.v1 import common_pb2

TRACEPARENT = "traceparent"


@dataclass(frozen=True)
class StreamedMethod:
    """A unary method callable on the stream: its request type and the servicer's coroutine for it."""

    request_type: type[Message]
    handler: Callable[[Message, grpc.aio.ServicerContext], Awaitable[Message]]


def streamed_methods(servicer: object, service: ServiceDescriptor) -> dict[str, StreamedMethod]:
    """The unary methods of `service` that `servicer` implements, by their gRPC path ("/pkg.Service/Method")."""
    return {
        f"/{service.full_name}/{method.name}": StreamedMethod(
            GetMessageClass(method.input_type), getattr(servicer, method.name)
        )
        for method in service.methods
        if not method.client_streaming and not method.server_streaming
    }


class CallStreamServer:
    """Answers the calls of call streams with a servicer's unary methods."""

    def __init__(self, methods: Mapping[str, StreamedMethod]):
        self.methods = methods
        self.telemetry = ServerTelemetryInterceptor()

    async def serve(self, context: grpc.aio.ServicerContext) -> None:
        """Runs one stream until the caller half-closes it (then once every call has answered) or cancels it. Calls
        run concurrently; replies are written as they finish."""
        replies: asyncio.Queue[common_pb2.StreamedReply | None] = asyncio.Queue()
        running: set[asyncio.Task] = set()

        async def answer(call: common_pb2.StreamedCall) -> None:
            replies.put_nowait(await self.reply(call, context))

        async def read() -> None:
            try:
                while (call := await context.read()) is not grpc.aio.EOF:
                    task = asyncio.ensure_future(answer(call))
                    running.add(task)
                    task.add_done_callback(running.discard)
                while running:
                    await asyncio.wait(list(running))
            finally:
                replies.put_nowait(None)

        reader = asyncio.ensure_future(read())
        try:
            while (reply := await replies.get()) is not None:
                await context.write(reply)
            await reader
        finally:
            for task in (reader, *running):
                task.cancel()

    async def reply(self, call: common_pb2.StreamedCall, context: grpc.aio.ServicerContext) -> common_pb2.StreamedReply:
        """Runs one call as its unary method; any error becomes the reply's status."""
        method = self.methods.get(call.method)
        if method is None:
            return _status_reply(call, grpc.StatusCode.UNIMPLEMENTED, f"method: {call.method!r} is not served here")
        carrier = {TRACEPARENT: call.traceparent} if call.traceparent else {}
        try:
            request = method.request_type.FromString(call.request)
        except DecodeError as error:
            return _status_reply(call, *logged_status(call.method, InvalidFieldError("request", str(error))))
        if call.timeout_s > 0:
            context = _CallContext(context, asyncio.get_running_loop().time() + call.timeout_s)
        with self.telemetry.observed(call.method, request, carrier) as observed:
            try:
                response = await method.handler(request, context)
            except Exception as error:  # noqa: BLE001 - mapped to a status here, as for a unary call
                observed.code, details = logged_status(call.method, error)
                return _status_reply(call, observed.code, details)
        return common_pb2.StreamedReply(call_id=call.call_id, response=response.SerializeToString())


class _CallContext:
    """The stream's context as one call on it sees it: with the call's own deadline (specdec/serving/wire.py
    call_deadline reads it), the rest the stream's."""

    def __init__(self, stream: grpc.aio.ServicerContext, deadline: float):
        self._stream = stream
        self._deadline = deadline  # on the event loop's clock

    def time_remaining(self) -> float:
        return max(self._deadline - asyncio.get_running_loop().time(), 0.0)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def _status_reply(call: common_pb2.StreamedCall, code: grpc.StatusCode, details: str) -> common_pb2.StreamedReply:
    return common_pb2.StreamedReply(call_id=call.call_id, status_code=code.value[0], status_details=details)
