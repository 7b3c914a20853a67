"""Where the HTTP front sends a request: the coordinator's own servicer in the same process (no hop), or a coordinator
over gRPC (the front in a process of its own). Both give the Coordinator's stream of replies, and fail with the
status the Coordinator would answer (FrontError)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.auth import ApiKeyInterceptor, set_current_api_key
from coordinator.openai_api.errors import FrontError
from coordinator.servicer import CoordinatorServicer
from specdec.serving.grpc_errors import logged_status
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc

log = logging.getLogger(__name__)
METHOD = "/v1 (HTTP)"


class InProcessBackend:
    """The coordinator's servicer, called directly: API keys checked against the same Redis keys as the gRPC port."""

    def __init__(self, servicer: CoordinatorServicer):
        self.servicer = servicer
        self.authenticator: ApiKeyInterceptor | None = servicer.guard.authenticator()

    async def authenticate(self, authorization: str | None) -> None:
        """Checks the `Authorization: Bearer KEY` header (when keys are required) and makes its key the request's."""
        if self.authenticator is None:
            return
        try:
            key = await self.authenticator.authenticate([("authorization", authorization)] if authorization else [])
        except Exception as error:  # noqa: BLE001 - UNAUTHENTICATED, or UNAVAILABLE when Redis is down
            raise FrontError(*logged_status(METHOD, error)) from None
        set_current_api_key(key)

    async def replies(
        self, request: coordinator_pb2.GenerateRequest, authorization: str | None, timeout_s: float
    ) -> AsyncIterator[coordinator_pb2.GenerateStreamResponse]:
        """The request's replies from the servicer, within the deadline (then DEADLINE_EXCEEDED)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        async with contextlib.aclosing(self.servicer.GenerateStream(request, None)) as replies:
            while True:
                try:
                    reply = await asyncio.wait_for(anext(replies), max(0.0, deadline - loop.time()))
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    message = f"the request ran past its deadline of {timeout_s:g} s"
                    log.warning("%s -> DEADLINE_EXCEEDED: %s", METHOD, message)
                    raise FrontError(grpc.StatusCode.DEADLINE_EXCEEDED, message) from None
                except Exception as error:  # noqa: BLE001 - mapped as the gRPC port maps it
                    raise FrontError(*logged_status(METHOD, error)) from None
                yield reply

    async def healthy(self) -> bool:
        return self.servicer.verify_pool.any_healthy


class GrpcBackend:
    """A coordinator at an address: the Authorization header travels on as gRPC metadata, the deadline with it."""

    def __init__(self, channel: grpc.aio.Channel):
        self.channel = channel
        self.stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        self.health = health_pb2_grpc.HealthStub(channel)

    async def authenticate(self, authorization: str | None) -> None:
        """Nothing here: the coordinator checks the key it is sent."""

    async def replies(
        self, request: coordinator_pb2.GenerateRequest, authorization: str | None, timeout_s: float
    ) -> AsyncIterator[coordinator_pb2.GenerateStreamResponse]:
        metadata = (("authorization", authorization),) if authorization else ()
        call = self.stub.GenerateStream(request, timeout=timeout_s, metadata=metadata)
        try:
            async for reply in call:
                yield reply
        except grpc.aio.AioRpcError as error:
            raise FrontError(error.code(), error.details() or error.code().name) from None
        finally:
            call.cancel()

    async def healthy(self) -> bool:
        try:
            reply = await self.health.Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING
