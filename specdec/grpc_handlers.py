"""Running a grpc.aio method handler inside an async context manager: the body of most server interceptors."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
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

        async def unary_stream(request, context) -> AsyncIterator:
            async with around(request, context):
                async for item in inner_stream(request, context):
                    yield item

        return grpc.unary_stream_rpc_method_handler(
            unary_stream, handler.request_deserializer, handler.response_serializer
        )
    return handler
