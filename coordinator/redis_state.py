"""The coordinator's Redis connection and key layout (API keys, rate limits, request journal, session registry).

Every key starts with the deployment's prefix (`--redis-key-prefix`, default `specdec:`):

    {p}apikey:{sha256 of key}        hash   name, requests_per_minute, tokens_per_minute, created
    {p}apikey-names                  hash   name -> sha256 of its key
    {p}rate:{key id}:requests|tokens hash   token bucket: tokens, ms
    {p}journal:{scope}:{request id}  hash   fingerprint, seed, holder, state, prompt_tokens, result
      ...:tokens / ...:text          string committed token ids (int32 LE) / the text sent so far
    {p}lease:{scope}:{request id}    string the coordinator running the request (expires unless refreshed)
    {p}coordinators                  zset   coordinator id -> heartbeat expiry (ms)
    {p}load:{coordinator id}         hash   "draft|verify address" -> sessions that coordinator holds there
    {p}sessions:{coordinator id}     set    session ids that coordinator has open on the replicas
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

import redis
import redis.asyncio
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

# What "Redis is down" looks like to redis-py (refused, reset, timed out, or not answering at all).
REDIS_DOWN = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)


def describe_url(url: str) -> str:
    """host:port/db of a Redis URL, without the password (for messages and logs)."""
    parts = urlsplit(url)
    return f"{parts.hostname or '?'}:{parts.port or 6379}{parts.path or ''}"


def connect(url: str, timeout_s: float) -> redis.asyncio.Redis:
    """An asyncio client that fails fast: one reconnect attempt, no backoff, `timeout_s` per call."""
    return redis.asyncio.Redis.from_url(
        url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 1)
    )


def connect_sync(url: str, timeout_s: float = 5.0) -> redis.Redis:
    """A blocking client (the admin CLI)."""
    return redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)


@dataclass(frozen=True)
class RedisKeys:
    """Names of the keys under one prefix."""

    prefix: str = "specdec:"

    def api_key(self, key_hash: str) -> str:
        return f"{self.prefix}apikey:{key_hash}"

    def api_key_names(self) -> str:
        return f"{self.prefix}apikey-names"

    def rate(self, key_id: str, bucket: str) -> str:
        return f"{self.prefix}rate:{key_id}:{bucket}"

    def journal(self, scope: str, request_id: str) -> str:
        return f"{self.prefix}journal:{scope}:{request_id}"

    def lease(self, scope: str, request_id: str) -> str:
        return f"{self.prefix}lease:{scope}:{request_id}"

    def coordinators(self) -> str:
        return f"{self.prefix}coordinators"

    def load(self, coordinator_id: str) -> str:
        return f"{self.prefix}load:{coordinator_id}"

    def sessions(self, coordinator_id: str) -> str:
        return f"{self.prefix}sessions:{coordinator_id}"
