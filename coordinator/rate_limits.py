"""Per-key token buckets on requests and on tokens, shared by every coordinator through one Lua script.

Each bucket holds up to one minute's allowance (its rate per minute) and refills continuously. A request
takes 1 from the request bucket and (prompt tokens + max_new_tokens) from the token bucket, both or
neither, atomically in Redis (using Redis' clock, so coordinators' clocks do not matter); tokens it did not
generate are given back when it ends. A bucket that cannot pay is RESOURCE_EXHAUSTED with the wait.
"""

from __future__ import annotations

import redis.asyncio

from coordinator.api_keys import ApiKey
from coordinator.redis_state import RedisKeys
from specdec.common.errors import CapacityError

# KEYS: request bucket, token bucket. ARGV: requests/min, tokens/min, request cost, token cost (< 0 refunds).
# Returns {0, 0} when taken, else {bucket index (1 requests, 2 tokens), ms until it could pay}.
TAKE_SCRIPT = """
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local levels = {}
for i = 1, 2 do
  local rate, cost = tonumber(ARGV[i]), tonumber(ARGV[i + 2])
  if rate > 0 then
    local state = redis.call('HMGET', KEYS[i], 'tokens', 'ms')
    local level = rate
    if state[1] then
      level = math.min(rate, tonumber(state[1]) + (now_ms - tonumber(state[2])) * rate / 60000)
    end
    if cost > level then
      return {i, math.ceil((cost - level) * 60000 / rate)}
    end
    levels[i] = math.min(rate, level - cost)
  end
end
for i = 1, 2 do
  if levels[i] then
    redis.call('HSET', KEYS[i], 'tokens', tostring(levels[i]), 'ms', now_ms)
    redis.call('PEXPIRE', KEYS[i], 61000)
  end
end
return {0, 0}
"""

BUCKETS = ("requests", "tokens")


class RateLimiter:
    """Takes from (and refunds to) a key's buckets; Redis errors propagate to the caller."""

    def __init__(self, client: redis.asyncio.Redis, keys: RedisKeys):
        self.keys = keys
        self._take = client.register_script(TAKE_SCRIPT)

    async def _run(self, key: ApiKey, requests: int, tokens: int) -> list[int]:
        return await self._take(
            keys=[self.keys.rate(key.key_id, b) for b in BUCKETS],
            args=[key.requests_per_minute, key.tokens_per_minute, requests, tokens],
        )

    async def take(self, key: ApiKey, tokens: int) -> None:
        """One request costing `tokens`, or CapacityError naming the limit and the wait."""
        if not key.requests_per_minute and not key.tokens_per_minute:
            return
        if key.tokens_per_minute and tokens > key.tokens_per_minute:
            raise CapacityError(
                f"rate limit: this request needs {tokens} tokens (prompt + max_new_tokens), more "
                f"than key {key.name!r} may use per minute ({key.tokens_per_minute})"
            )
        refused, wait_ms = await self._run(key, 1, tokens)
        if refused:
            limit = f"{key.requests_per_minute} requests" if refused == 1 else f"{key.tokens_per_minute} tokens"
            raise CapacityError(
                f"rate limit: key {key.name!r} is over its {limit} per minute; retry in {wait_ms / 1000:.1f}s"
            )

    async def refund(self, key: ApiKey, tokens: int) -> None:
        """Gives back tokens a request reserved but did not use."""
        if key.tokens_per_minute and tokens > 0:
            await self._run(key, 0, -tokens)
