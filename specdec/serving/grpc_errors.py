"""The one place where domain exceptions become gRPC statuses: a server interceptor for grpc.aio."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import torch
from google.protobuf.message import DecodeError

from specdec.common.errors import (
    CapacityError,
    DownstreamUnavailableError,
    InvalidFieldError,
    ReplicaFaultError,
    RequestInProgressError,
    SessionExistsError,
    SessionNotFoundError,
    StaleBaseLenError,
    UnauthenticatedError,
)
from specdec.engine.kv.session import ContextOverflowError
from specdec.sampling.rules import NonFiniteLogitsError
from specdec.serving.grpc_handlers import stream_responses

log = logging.getLogger(__name__)

STATUS_BY_ERROR: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (InvalidFieldError, grpc.StatusCode.INVALID_ARGUMENT),
    (SessionNotFoundError, grpc.StatusCode.NOT_FOUND),
    (SessionExistsError, grpc.StatusCode.ALREADY_EXISTS),
    (CapacityError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (ContextOverflowError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (torch.OutOfMemoryError, grpc.StatusCode.RESOURCE_EXHAUSTED),  # failed one step; the next one runs
    (StaleBaseLenError, grpc.StatusCode.FAILED_PRECONDITION),
    (DownstreamUnavailableError, grpc.StatusCode.UNAVAILABLE),
    (UnauthenticatedError, grpc.StatusCode.UNAUTHENTICATED),
    (RequestInProgressError, grpc.StatusCode.ABORTED),
    (NonFiniteLogitsError, grpc.StatusCode.INTERNAL),
    (ReplicaFaultError, grpc.StatusCode.INTERNAL),
]
EXPLAINED_INTERNAL_ERRORS = (NonFiniteLogitsError, ReplicaFaultError)  # INTERNAL, logged without a traceback


def status_for(error: BaseException) -> grpc.StatusCode:
    """The status a domain error maps to; INTERNAL for anything unexpected."""
    for error_type, code in STATUS_BY_ERROR:
        if isinstance(error, error_type):
            return code
    if isinstance(error, grpc.aio.AioRpcError):
        return error.code()
    return grpc.StatusCode.INTERNAL


def _message(error: BaseException) -> str:
    if isinstance(error, grpc.aio.AioRpcError):
        return error.details() or str(error.code())
    return str(error) or type(error).__name__


def logged_status(method: str, error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status and message a failed call answers with, logged (with a traceback when unexpected)."""
    code = status_for(error)
    if code == grpc.StatusCode.INTERNAL and not isinstance(error, EXPLAINED_INTERNAL_ERRORS):
        log.exception("%s failed unexpectedly", method, exc_info=error)
    else:
        log.warning("%s -> %s: %s", method, code.name, _message(error))
    return code, _message(error)


async def _abort(context: grpc.aio.ServicerContext, method: str, error: BaseException) -> None:
    await context.abort(*logged_status(method, error))


@dataclass(frozen=True)
class UndecodableRequest:
    """Stands in for a request whose bytes do not parse, so the call can answer INVALID_ARGUMENT (gRPC's own
    handling of a failing deserializer is UNKNOWN)."""

    error: str


def tolerant_deserializer(deserialize: Callable[[bytes], object] | None) -> Callable[[bytes], object] | None:
    if deserialize is None:
        return None

    def parse(data: bytes) -> object:
        try:
            return deserialize(data)
        except DecodeError as error:
            return UndecodableRequest(str(error))

    return parse


def check_decoded(request: object) -> None:
    if isinstance(request, UndecodableRequest):
        raise InvalidFieldError("request", f"not a valid message: {request.error}")


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Turns exceptions raised by servicer methods (and undecodable requests) into statuses, logging each one."""

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method
        deserialize = tolerant_deserializer(handler.request_deserializer)
        if handler.unary_unary is not None:
            inner_unary = handler.unary_unary

            async def unary_unary(request, context):
                try:
                    check_decoded(request)
                    return await inner_unary(request, context)
                except (asyncio.CancelledError, grpc.aio.AbortError):
                    raise
                except Exception as error:  # noqa: BLE001 - mapped to a status here, the one place that does
                    await _abort(context, method, error)

            return grpc.unary_unary_rpc_method_handler(unary_unary, deserialize, handler.response_serializer)
        if handler.unary_stream is not None:
            inner_stream = handler.unary_stream

            async def unary_stream(request, context) -> None:
                try:
                    check_decoded(request)
                    await stream_responses(inner_stream(request, context), context)
                except (asyncio.CancelledError, grpc.aio.AbortError):
                    raise
                except Exception as error:  # noqa: BLE001
                    await _abort(context, method, error)

            return grpc.unary_stream_rpc_method_handler(unary_stream, deserialize, handler.response_serializer)
        return handler
