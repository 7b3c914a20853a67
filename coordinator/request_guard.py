"""What stands around each Coordinator request: limits, per-key rate limits, the journal and the lease.

    async with guard.admit(request, plan) as guarded:          # may raise RESOURCE_EXHAUSTED, ABORTED, ...
        text = guarded.text_stream(tokenizer, eos_ids, stop)     # holds the journaled tokens of a resumed request
        async for reply in guarded.replies(run(guarded.plan, text)):
            yield reply                                          # journaled before it is yielded

A request with a client-chosen request_id is journaled (coordinator/journal.py) when Redis is configured:
a retry of an unfinished one resumes from the journal (its reply starts with the journaled part), a retry
of a finished one gets the stored result. Sessions on the replicas get a fresh id per attempt
(`<request_id>~<random>`), so a retry never collides with the sessions a dead attempt left behind (those
are closed by coordinator/session_registry.py).

Redis down: authentication and rate limits fail closed (UNAVAILABLE); the journal degrades: the request
runs without it (and cannot be resumed), with a warning in the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import os
import secrets
import socket
from collections.abc import AsyncIterator, Collection, Sequence

import redis
import redis.asyncio
from transformers import PreTrainedTokenizerBase

from coordinator.api_keys import ApiKey, ApiKeyStore
from coordinator.auth import ApiKeyInterceptor, current_api_key
from coordinator.journal import RequestJournal
from coordinator.rate_limits import RateLimiter
from coordinator.redis_state import RedisKeys, connect, describe_url
from coordinator.replicas import ReplicaPool
from coordinator.request_plan import GenerationPlan
from coordinator.session_registry import SessionRegistry
from coordinator.settings import CoordinatorSettings
from coordinator.text_stream import TextStream
from specdec.common.errors import CapacityError, DownstreamUnavailableError, InvalidFieldError, RequestInProgressError
from specdec.v1 import common_pb2, coordinator_pb2

log = logging.getLogger(__name__)


def check_limits(plan: GenerationPlan, settings: CoordinatorSettings) -> None:
    """The deployment's size limits (beyond the context, which validation checks): RESOURCE_EXHAUSTED."""
    prompt = len(plan.prompt_ids)
    if settings.max_prompt_tokens and prompt > settings.max_prompt_tokens:
        raise CapacityError(
            f"prompt: {prompt} tokens, more than this server's limit of "
            f"{settings.max_prompt_tokens} (max_prompt_tokens)"
        )
    total = prompt + plan.max_new_tokens
    if settings.max_total_tokens and total > settings.max_total_tokens:
        raise CapacityError(
            f"max_new_tokens: prompt ({prompt}) + max_new_tokens ({plan.max_new_tokens}) = {total} "
            f"tokens, more than this server's limit of {settings.max_total_tokens} (max_total_tokens)"
        )


def fingerprint(request: coordinator_pb2.GenerateRequest) -> str:
    """SHA-256 of what the request asks for (everything but request_id and include_stats)."""
    copy = coordinator_pb2.GenerateRequest()
    copy.CopyFrom(request)
    copy.ClearField("request_id")
    copy.ClearField("include_stats")
    return hashlib.sha256(copy.SerializeToString(deterministic=True)).hexdigest()


def new_coordinator_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class RequestGuard:
    """Shared by all requests of one coordinator; without Redis it only enforces the size limits."""

    def __init__(
        self,
        settings: CoordinatorSettings,
        client: redis.asyncio.Redis | None = None,
        registry: SessionRegistry | None = None,
        coordinator_id: str | None = None,
    ):
        if settings.require_api_key and client is None:
            raise ValueError("require_api_key: API keys live in Redis, set redis_url too")
        self.settings = settings
        self.client = client
        self.registry = registry
        self.coordinator_id = coordinator_id or new_coordinator_id()
        keys = RedisKeys(settings.redis_key_prefix)
        self.keys = keys
        self.journal = (
            RequestJournal(client, keys, settings.lease_s, settings.journal_ttl_s, settings.result_ttl_s)
            if client is not None
            else None
        )
        self.rate_limiter = RateLimiter(client, keys) if client is not None else None
        self._registry_task: asyncio.Future | None = None

    @classmethod
    def from_settings(cls, settings: CoordinatorSettings, pools: Sequence[ReplicaPool]) -> RequestGuard:
        """Connects to Redis when redis_url is set and starts the session registry (call inside the loop)."""
        if not settings.redis_url:
            return cls(settings)
        client = connect(settings.redis_url, settings.redis_timeout_s)
        coordinator_id = new_coordinator_id()
        registry = SessionRegistry(
            client,
            RedisKeys(settings.redis_key_prefix),
            coordinator_id,
            pools,
            settings.registry_ttl_s,
            settings.registry_refresh_s,
            settings.call_timeout_s,
        )
        guard = cls(settings, client, registry, coordinator_id)
        guard._registry_task = asyncio.ensure_future(registry.run())
        log.info(
            "Redis at %s: journal on, API keys %s, coordinator id %s",
            describe_url(settings.redis_url),
            "required" if settings.require_api_key else "not required",
            coordinator_id,
        )
        return guard

    def interceptors(self) -> list:
        """Server interceptors for the coordinator's port (API-key authentication when required)."""
        authenticator = self.authenticator()
        return [authenticator] if authenticator is not None else []

    def authenticator(self) -> ApiKeyInterceptor | None:
        """What checks API keys when they are required (the gRPC port's interceptor; the HTTP front calls it too)."""
        if not self.settings.require_api_key:
            return None
        return ApiKeyInterceptor(ApiKeyStore(self.client, self.keys), describe_url(self.settings.redis_url))

    @contextlib.asynccontextmanager
    async def admit(
        self, request: coordinator_pb2.GenerateRequest, plan: GenerationPlan
    ) -> AsyncIterator[GuardedRequest]:
        check_limits(plan, self.settings)
        guarded = GuardedRequest(self, request, plan, current_api_key())
        try:
            await guarded.start()
            yield guarded
        finally:
            await asyncio.shield(guarded.end())

    async def close(self) -> None:
        if self._registry_task is not None:
            self._registry_task.cancel()
            await asyncio.gather(self._registry_task, return_exceptions=True)
            await self.registry.close()
        if self.client is not None:
            await self.client.aclose()


class GuardedRequest:
    """One admitted request: the plan to run (after a resume: the rest of it) and its journal."""

    def __init__(
        self, guard: RequestGuard, request: coordinator_pb2.GenerateRequest, plan: GenerationPlan, key: ApiKey | None
    ):
        self.guard = guard
        self.request = request
        self.plan = plan
        self.key = key
        self.request_id = request.request_id or plan.request_id
        self.scope = key.key_id if key else "-"  # journals are per key: one key never sees another's results
        self.holder = f"{guard.coordinator_id}/{secrets.token_hex(4)}"
        self.prompt_tokens = len(plan.prompt_ids)
        self.journaling = False
        self.replay: coordinator_pb2.GenerateStreamResponse | None = None
        self.sent_ids: list[int] = []  # everything the client has been (or will be) sent, journaled part first
        self.sent_text: list[str] = []
        self.sent_logprobs: list[common_pb2.TokenLogprob] = []  # of this attempt's tokens (the journal holds none)
        self.resumed_tokens = 0
        self.generated = 0
        self.reserved_tokens = 0
        self._session_recorded = False
        self._heartbeat: asyncio.Future | None = None

    async def start(self) -> None:
        guard = self.guard
        if self.request.request_id:
            # A fresh session id per attempt: a dead attempt's sessions may still be open on the replicas.
            self.plan = dataclasses.replace(self.plan, request_id=f"{self.request.request_id}~{secrets.token_hex(4)}")
            if guard.journal is not None:
                await self._begin_journal()
        if self.key is not None and guard.rate_limiter is not None:
            tokens = 0 if self.replay is not None else self.prompt_tokens + self.plan.max_new_tokens
            try:
                await guard.rate_limiter.take(self.key, tokens)
            except redis.exceptions.RedisError as error:
                raise DownstreamUnavailableError(
                    f"rate-limit store (Redis) unreachable, refusing calls until it is back: {type(error).__name__}"
                ) from None
            self.reserved_tokens = tokens
        if self.replay is None and guard.registry is not None:
            await guard.registry.add(self.plan.request_id)
            self._session_recorded = True
        if self.journaling:
            self._heartbeat = asyncio.ensure_future(self._beat())

    async def _begin_journal(self) -> None:
        guard, plan = self.guard, self.plan
        try:
            entry = await guard.journal.begin_waiting(
                self.scope,
                self.request_id,
                fingerprint(self.request),
                plan.params.seed,
                self.holder,
                self.prompt_tokens,
                guard.settings.lease_wait_s,
            )
        except redis.exceptions.RedisError as error:
            log.warning(
                "request %s: journal unavailable (Redis: %s); running it without one (a retry after a "
                "crash starts over)",
                self.request_id,
                error,
            )
            return
        if entry.state == "conflict":
            raise InvalidFieldError(
                "request_id", f"{self.request_id!r} was used for a different request; use a new id for a new request"
            )
        if entry.state == "busy":
            raise RequestInProgressError(
                f"request_id: {self.request_id!r} is running on another coordinator "
                f"(its lease runs {entry.lease_ms / 1000:.1f}s more); retry later"
            )
        if entry.state == "finished":
            self.replay = coordinator_pb2.GenerateStreamResponse.FromString(entry.result)
            return
        self.journaling = True
        if entry.state == "resume":
            # The journal's seed, also when no round was journaled yet: Redis keeps it for every later retry, so
            # a fresh one drawn for this attempt would make this retry and the next disagree.
            plan = self.plan = dataclasses.replace(plan, params=dataclasses.replace(plan.params, seed=entry.seed))
        remaining = plan.max_new_tokens - len(entry.token_ids)
        if entry.state == "resume" and entry.token_ids and remaining > 0:
            log.info(
                "request %s: resuming after %d journaled tokens (seed %d)",
                self.request_id,
                len(entry.token_ids),
                entry.seed,
            )
            self.resumed_tokens = len(entry.token_ids)
            self.sent_ids, self.sent_text = list(entry.token_ids), [entry.text]
            self.plan = dataclasses.replace(
                plan,
                prompt_ids=[*plan.prompt_ids, *entry.token_ids],
                max_new_tokens=remaining,
                output_start=plan.output_start or len(plan.prompt_ids),  # constraints and penalties cover the journaled
            )
        elif entry.state == "resume" and entry.token_ids:  # the whole budget is journaled: nothing left to run
            self.replay = coordinator_pb2.GenerateStreamResponse(
                text=entry.text, token_ids=entry.token_ids, finish_reason=coordinator_pb2.FINISH_REASON_LENGTH
            )

    def text_stream(
        self, tokenizer: PreTrainedTokenizerBase, eos_token_ids: Collection[int], stop: Sequence[str]
    ) -> TextStream:
        """The request's TextStream, already holding the journaled tokens and text of a resumed request."""
        return TextStream(
            tokenizer,
            eos_token_ids,
            list(stop),
            self.request.max_new_tokens,
            token_ids=list(self.sent_ids),
            emitted_chars=len("".join(self.sent_text)),
        )

    async def replies(
        self, inner: AsyncIterator[coordinator_pb2.GenerateStreamResponse]
    ) -> AsyncIterator[coordinator_pb2.GenerateStreamResponse]:
        """The client's replies: a stored result, or the journaled part and then `inner`, each reply journaled
        before it is yielded."""
        async with contextlib.aclosing(inner):
            if self.replay is not None:
                reply = coordinator_pb2.GenerateStreamResponse()
                reply.CopyFrom(self.replay)
                reply.request_id = self.request_id
                if not self.request.include_stats:
                    reply.ClearField("stats")
                yield reply
                return
            if self.resumed_tokens:
                yield coordinator_pb2.GenerateStreamResponse(
                    text=self.sent_text[0], token_ids=self.sent_ids, request_id=self.request_id
                )
            async for reply in inner:
                reply.request_id = self.request_id
                if self.resumed_tokens and reply.HasField("stats"):
                    reply.stats.prompt_tokens = self.prompt_tokens
                self.generated += len(reply.token_ids)
                self.sent_ids.extend(reply.token_ids)
                self.sent_text.append(reply.text)
                self.sent_logprobs.extend(reply.logprobs)
                await self._journal(reply)
                yield reply

    async def _journal(self, reply: coordinator_pb2.GenerateStreamResponse) -> None:
        if not self.journaling:
            return
        journal = self.guard.journal
        try:
            if reply.finish_reason:
                result = coordinator_pb2.GenerateStreamResponse(
                    text="".join(self.sent_text),
                    token_ids=self.sent_ids,
                    finish_reason=reply.finish_reason,
                    request_id=self.request_id,
                    stats=reply.stats if reply.HasField("stats") else None,
                )
                if not self.resumed_tokens:  # a resumed request's journaled part has none: the result neither
                    result.logprobs.extend(self.sent_logprobs)
                self.journaling = False
                if not await journal.finish(self.scope, self.request_id, self.holder, result.SerializeToString()):
                    log.warning(
                        "request %s: another coordinator took it over; not storing this result", self.request_id
                    )
            elif not await journal.append(self.scope, self.request_id, self.holder, reply.token_ids, reply.text):
                self.journaling = False
                raise RequestInProgressError(
                    f"request_id: {self.request_id!r} was taken over by another "
                    "coordinator (this one lost its lease); retry to get the result"
                )
        except redis.exceptions.RedisError as error:
            self.journaling = False
            log.warning(
                "request %s: journal write failed (Redis: %s); continuing without the journal", self.request_id, error
            )

    async def _beat(self) -> None:
        """Keeps the lease alive between rounds (a long prefill or a slow round must not lose it)."""
        interval = self.guard.settings.lease_s / 3
        while self.journaling:
            await asyncio.sleep(interval)
            try:
                if self.journaling and not await self.guard.journal.append(self.scope, self.request_id, self.holder):
                    return
            except redis.exceptions.RedisError as error:
                log.debug("request %s: lease heartbeat failed: %s", self.request_id, error)

    async def end(self) -> None:
        """Stops the heartbeat, frees the lease (the journal stays for a retry), refunds unused tokens."""
        guard = self.guard
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        try:
            if self.journaling:
                await guard.journal.release(self.scope, self.request_id, self.holder)
            if self.reserved_tokens:
                await guard.rate_limiter.refund(self.key, self.plan.max_new_tokens - self.generated)
        except redis.exceptions.RedisError as error:
            log.warning("request %s: could not release its lease or refund tokens (Redis: %s)", self.request_id, error)
        if self._session_recorded:
            await guard.registry.remove(self.plan.request_id)
