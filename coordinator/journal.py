"""The request journal and request leases in Redis: what makes a retried request_id resume, not restart.

While a request with a client-chosen request_id runs, every committed round is appended to its journal
before the client sees it: the token ids, the text sent, plus (once) the request's fingerprint and the seed
in use. If the coordinator dies, a retry with the same request_id (on any coordinator) finds the journal,
opens sessions on prompt + journaled tokens and continues for the remaining budget with the same seed;
draws are keyed by (seed, position) and rounds restart at the same boundary, so the completion is the one
the first attempt would have produced. A finished request's result stays fetchable for `result_ttl_s`.

A lease (`{p}lease:...`, expiring after `lease_s` unless refreshed by each round and a heartbeat) says which
coordinator runs a request_id: a second one waits, bounded, for it to end or expire. Every append is
fenced on the journal's holder field, so a coordinator that lost its lease can no longer write.
"""

from __future__ import annotations

import asyncio
import struct
from dataclasses import dataclass, field

import redis.asyncio

from coordinator.redis_state import RedisKeys

# KEYS: journal, lease, tokens, text. ARGV: fingerprint, seed, holder, lease ms, journal ttl ms, prompt tokens.
# Returns {"conflict"} (the id was used by a different request) | {"finished", result} | {"busy", lease pttl}
#       | {"resume", seed, tokens, text} | {"new"}; "resume" and "new" take the lease and make ARGV[3] the holder.
BEGIN_SCRIPT = """
local journal = redis.call('HMGET', KEYS[1], 'state', 'fingerprint', 'seed', 'result')
if journal[1] and journal[2] ~= ARGV[1] then
  return {'conflict'}
end
if journal[1] == 'finished' then
  return {'finished', journal[4]}
end
if not redis.call('SET', KEYS[2], ARGV[3], 'NX', 'PX', ARGV[4]) then
  return {'busy', redis.call('PTTL', KEYS[2])}
end
if journal[1] == 'running' then
  redis.call('HSET', KEYS[1], 'holder', ARGV[3])
  for _, key in ipairs({KEYS[1], KEYS[3], KEYS[4]}) do redis.call('PEXPIRE', key, ARGV[5]) end
  return {'resume', journal[3], redis.call('GET', KEYS[3]) or '', redis.call('GET', KEYS[4]) or ''}
end
redis.call('DEL', KEYS[3], KEYS[4])
redis.call('HSET', KEYS[1], 'state', 'running', 'fingerprint', ARGV[1], 'seed', ARGV[2], 'holder', ARGV[3],
           'prompt_tokens', ARGV[6])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
return {'new'}
"""

# KEYS: journal, lease, tokens, text. ARGV: holder, lease ms, journal ttl ms, packed token ids, text.
# Appends one round (nothing for a heartbeat) and refreshes the lease; 0 when ARGV[1] no longer holds it.
APPEND_SCRIPT = """
local journal = redis.call('HMGET', KEYS[1], 'state', 'holder')
if journal[1] ~= 'running' or journal[2] ~= ARGV[1] then
  return 0
end
local lease = redis.call('GET', KEYS[2])
if lease and lease ~= ARGV[1] then
  return 0
end
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
if ARGV[4] ~= '' or ARGV[5] ~= '' then
  redis.call('APPEND', KEYS[3], ARGV[4])
  redis.call('APPEND', KEYS[4], ARGV[5])
end
for _, key in ipairs({KEYS[1], KEYS[3], KEYS[4]}) do redis.call('PEXPIRE', key, ARGV[3]) end
return 1
"""

# KEYS: journal, lease, tokens, text. ARGV: holder, result, result ttl ms. 0 when ARGV[1] is not the holder.
FINISH_SCRIPT = """
if redis.call('HGET', KEYS[1], 'holder') ~= ARGV[1] then
  return 0
end
redis.call('HSET', KEYS[1], 'state', 'finished', 'result', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('DEL', KEYS[3], KEYS[4])
if redis.call('GET', KEYS[2]) == ARGV[1] then redis.call('DEL', KEYS[2]) end
return 1
"""

# KEYS: lease. ARGV: holder. Frees the lease if ARGV[1] holds it (the journal stays for a retry).
RELEASE_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

_TOKEN = struct.Struct("<i")


def pack_tokens(token_ids) -> bytes:
    return b"".join(_TOKEN.pack(t) for t in token_ids)


def unpack_tokens(data: bytes) -> list[int]:
    return [t for (t,) in _TOKEN.iter_unpack(data)]


@dataclass
class JournalEntry:
    """What `begin` found for a request id."""

    state: str  # "new", "resume", "finished", "busy", "conflict"
    seed: int = 0
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    result: bytes = b""  # a finished request's serialized GenerateStreamResponse
    lease_ms: int = 0  # "busy": how long the holder's lease still runs


class RequestJournal:
    """The Redis side of journaled requests; Redis errors propagate (the caller decides how to degrade)."""

    def __init__(
        self, client: redis.asyncio.Redis, keys: RedisKeys, lease_s: float, journal_ttl_s: float, result_ttl_s: float
    ):
        self.keys = keys
        self.lease_ms = max(1, int(lease_s * 1000))
        self.journal_ttl_ms = max(1, int(journal_ttl_s * 1000))
        self.result_ttl_ms = max(1, int(result_ttl_s * 1000))
        self._begin = client.register_script(BEGIN_SCRIPT)
        self._append = client.register_script(APPEND_SCRIPT)
        self._finish = client.register_script(FINISH_SCRIPT)
        self._release = client.register_script(RELEASE_SCRIPT)

    def _keys(self, scope: str, request_id: str) -> list[str]:
        journal = self.keys.journal(scope, request_id)
        return [journal, self.keys.lease(scope, request_id), journal + ":tokens", journal + ":text"]

    async def begin(
        self, scope: str, request_id: str, fingerprint: str, seed: int, holder: str, prompt_tokens: int
    ) -> JournalEntry:
        """Takes the lease and starts or resumes the journal; or reports a finished result or a busy lease."""
        reply = await self._begin(
            keys=self._keys(scope, request_id),
            args=[fingerprint, seed, holder, self.lease_ms, self.journal_ttl_ms, prompt_tokens],
        )
        state = reply[0].decode()
        if state == "finished":
            return JournalEntry(state, result=reply[1])
        if state == "busy":
            return JournalEntry(state, lease_ms=max(0, int(reply[1])))
        if state == "resume":
            return JournalEntry(
                state,
                seed=int(reply[1]),
                token_ids=unpack_tokens(reply[2]),
                text=reply[3].decode("utf-8", "surrogatepass"),
            )
        return JournalEntry(state)

    async def begin_waiting(
        self, scope: str, request_id: str, fingerprint: str, seed: int, holder: str, prompt_tokens: int, wait_s: float
    ) -> JournalEntry:
        """`begin`, retried while another coordinator holds the lease, for at most wait_s seconds."""
        deadline = asyncio.get_running_loop().time() + wait_s
        while True:
            entry = await self.begin(scope, request_id, fingerprint, seed, holder, prompt_tokens)
            remaining = deadline - asyncio.get_running_loop().time()
            if entry.state != "busy" or remaining <= 0:
                return entry
            await asyncio.sleep(min(remaining, max(0.05, min(entry.lease_ms / 1000, 0.5))))

    async def append(self, scope: str, request_id: str, holder: str, token_ids=(), text: str = "") -> bool:
        """Appends one round's tokens and text and refreshes the lease (a heartbeat when empty).
        False when `holder` lost the request to another coordinator."""
        return bool(
            await self._append(
                keys=self._keys(scope, request_id),
                args=[
                    holder,
                    self.lease_ms,
                    self.journal_ttl_ms,
                    pack_tokens(token_ids),
                    text.encode("utf-8", "surrogatepass"),
                ],
            )
        )

    async def finish(self, scope: str, request_id: str, holder: str, result: bytes) -> bool:
        """Stores the whole result for result_ttl_s, drops the round log and frees the lease."""
        return bool(await self._finish(keys=self._keys(scope, request_id), args=[holder, result, self.result_ttl_ms]))

    async def release(self, scope: str, request_id: str, holder: str) -> None:
        """Frees the lease without finishing (the journal stays, so a retry resumes)."""
        await self._release(keys=[self.keys.lease(scope, request_id)], args=[holder])
