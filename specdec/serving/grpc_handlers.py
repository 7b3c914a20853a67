"""Running a grpc.aio method handler inside an async context manager: the body of most server interceptors.

Wrapped unary-stream handlers are coroutines that write each response themselves (`stream_responses`): grpc.aio
never closes a streaming handler's async generator when the client cancels, so a generator's `finally` (e.g. the
coordinator closing a request's sessions on its replicas) would wait for the garbage collector; a coroutine is
cancelled where it waits, and closes the generator it drives there and then.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager, aclosing
from typing import Any

import grpc

Around = Callable[[Any, grpc.aio.ServicerContext], AbstractAsyncContextManager]


def wrap_handler(handler: grpc.RpcMethodHandler, around: Around) -> grpc.RpcMethodHandler:
    """The handler with every unary-unary and unary-stream call (all of a stream) run inside
    `around(request, context)`; handlers of other kinds are returned unchanged."""
    if handler.unary_unary is not None:
        inner_unary = handler.unary_unary

        async def unary_unary(request, context):
            async with around(request, context):
                return await inner_unary(request, context)

        return grpc.unary_unary_rpc_method_handler(
            unary_unary, handler.request_deserializer, handler.response_serializer
        )
    if handler.unary_stream is not None:
        inner_stream = handler.unary_stream

        async def unary_stream(request, context) -> None:
            async with around(request, context):
                await stream_responses(inner_stream(request, context), context)

        return grpc.unary_stream_rpc_method_handler(
            unary_stream, handler.request_deserializer, handler.response_serializer
        )
    return handler


async def stream_responses(responses, context: grpc.aio.ServicerContext) -> None:
    """Runs a unary-stream handler's result: writes an async generator's items, closing it however the call ends
    (a cancelled call is cancelled at its write), or awaits a handler that writes its own."""
    if not inspect.isasyncgen(responses):
        await responses
        return
    async with aclosing(responses):
        async for item in responses:
            await context.write(item)
