"""API-key authentication of the Coordinator service: a grpc.aio server interceptor (coordinator only).

Reads `authorization: Bearer KEY` metadata on every Coordinator call (health checks and reflection stay
open), looks the key up in Redis on every call and fails closed: no key or an unknown key is
UNAUTHENTICATED, an unreachable Redis is UNAVAILABLE. The authenticated key is then available to the
call as `current_api_key()` (per-key rate limits, journal scope).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextvars import ContextVar

import grpc
import redis

from coordinator.api_keys import ApiKey, ApiKeyStore
from specdec.common.errors import DownstreamUnavailableError, UnauthenticatedError
from specdec.serving.grpc_errors import status_for
from specdec.serving.grpc_handlers import wrap_handler

log = logging.getLogger(__name__)

_CURRENT_KEY: ContextVar[ApiKey | None] = ContextVar("specdec_api_key", default=None)
COORDINATOR_METHODS = "/specdec.v1.Coordinator/"


def current_api_key() -> ApiKey | None:
    """The key that authenticated the current call (None when keys are not required)."""
    return _CURRENT_KEY.get()


def set_current_api_key(key: ApiKey | None) -> None:
    """Makes `key` the current call's key (the HTTP front authenticates outside any gRPC call)."""
    _CURRENT_KEY.set(key)


def bearer_token(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    """The token of an `authorization: Bearer TOKEN` entry, or None."""
    for name, value in metadata or ():
        if name.lower() != "authorization" or not isinstance(value, str):
            continue
        scheme, _, token = value.strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    return None


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Authenticates each Coordinator call before the servicer sees it."""

    def __init__(self, store: ApiKeyStore, redis_description: str):
        self.store = store
        self.redis_description = redis_description

    async def authenticate(self, metadata) -> ApiKey:
        token = bearer_token(metadata)
        if token is None:
            raise UnauthenticatedError("missing API key: send metadata 'authorization: Bearer <key>'")
        try:
            key = await self.store.lookup(token)
        except redis.exceptions.RedisError as error:
            raise DownstreamUnavailableError(
                f"API key store (Redis at {self.redis_description}) unreachable, refusing calls until it is back: "
                f"{type(error).__name__}"
            ) from None
        if key is None:
            raise UnauthenticatedError("invalid API key")
        return key

    @contextlib.asynccontextmanager
    async def _authenticated(self, method: str, request, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        try:
            _CURRENT_KEY.set(await self.authenticate(context.invocation_metadata()))
        except (UnauthenticatedError, DownstreamUnavailableError) as error:
            log.warning("%s -> %s: %s", method, status_for(error).name, error)
            await context.abort(status_for(error), str(error))
        yield

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or not details.method.startswith(COORDINATOR_METHODS):
            return handler
        return wrap_handler(handler, functools.partial(self._authenticated, details.method))
