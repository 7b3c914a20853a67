"""The session -> replica registry in Redis that lets several coordinators share the same replicas.

Each coordinator publishes, every `registry_refresh_s`, how many sessions it holds on each replica and a
heartbeat (expiring after `registry_ttl_s`), and reads the others' counts: placement then picks the replica
with the fewest sessions counted across all live coordinators (`Replica.remote_sessions` holds the others'
share, refreshed here; the local share stays exact). It also records the session ids it has open, so that
when a coordinator dies (its heartbeat expires) one survivor claims its record and closes those sessions on
every replica instead of leaving their KV caches behind.

Redis down: placement falls back to this coordinator's own counts, and nothing is recorded or reaped until
Redis is back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import grpc
import redis
import redis.asyncio

from coordinator.redis_state import RedisKeys
from coordinator.replicas import ReplicaPool
from specdec.v1 import common_pb2

log = logging.getLogger(__name__)

# KEYS: coordinators zset, load:{me}, sessions:{me}. ARGV: me, ttl ms, sessions-record ms, field, count, ...
# Returns {live coordinator ids, expired coordinator ids}.
HEARTBEAT_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('DEL', KEYS[2])
if #ARGV > 3 then
  redis.call('HSET', KEYS[2], unpack(ARGV, 4))
  redis.call('PEXPIRE', KEYS[2], ARGV[2])
end
redis.call('PEXPIRE', KEYS[3], ARGV[3])
return {redis.call('ZRANGEBYSCORE', KEYS[1], now, '+inf'), redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. now)}
"""

SESSIONS_RECORD_S = 3600.0  # how long a dead coordinator's session ids wait for a survivor to close them


class SessionRegistry:
    """This coordinator's entry in the shared registry; `run()` keeps it fresh until cancelled."""

    def __init__(
        self,
        client: redis.asyncio.Redis,
        keys: RedisKeys,
        coordinator_id: str,
        pools: Sequence[ReplicaPool],
        ttl_s: float,
        refresh_s: float,
        call_timeout_s: float,
    ):
        self.client = client
        self.keys = keys
        self.coordinator_id = coordinator_id
        self.pools = list(pools)
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.refresh_s = refresh_s
        self.call_timeout_s = call_timeout_s
        self._heartbeat = client.register_script(HEARTBEAT_SCRIPT)
        self._redis_ok = True

    def _replicas(self):
        for pool in self.pools:
            for replica in pool.replicas:
                yield f"{pool.kind}|{replica.address}", replica

    async def add(self, session_id: str) -> None:
        """Records a session this coordinator opens (best effort)."""
        await self._best_effort(
            "record a session", self.client.sadd(self.keys.sessions(self.coordinator_id), session_id)
        )

    async def remove(self, session_id: str) -> None:
        await self._best_effort("drop a session", self.client.srem(self.keys.sessions(self.coordinator_id), session_id))

    async def _best_effort(self, what: str, call) -> None:
        try:
            await call
        except redis.exceptions.RedisError as error:
            log.debug("session registry: could not %s: %s", what, error)

    async def refresh(self) -> None:
        """Publishes our counts and heartbeat, reads the others' counts, reaps expired coordinators."""
        counts = [(name, replica.active_sessions) for name, replica in self._replicas()]
        live, dead = await self._heartbeat(
            keys=[
                self.keys.coordinators(),
                self.keys.load(self.coordinator_id),
                self.keys.sessions(self.coordinator_id),
            ],
            args=[
                self.coordinator_id,
                self.ttl_ms,
                int(SESSIONS_RECORD_S * 1000),
                *[item for name, count in counts if count for item in (name, count)],
            ],
        )
        others = [c.decode() for c in live if c.decode() != self.coordinator_id]
        remote: dict[str, int] = {}
        if others:
            pipe = self.client.pipeline(transaction=False)
            for other in others:
                pipe.hgetall(self.keys.load(other))
            for loads in await pipe.execute():
                for name, count in loads.items():
                    remote[name.decode()] = remote.get(name.decode(), 0) + int(count)
        for name, replica in self._replicas():
            replica.remote_sessions = remote.get(name, 0)
        for other in dead:
            await self._reap(other.decode())

    async def _reap(self, coordinator_id: str) -> None:
        """Closes the sessions of a coordinator whose heartbeat expired (if we are the one to claim it)."""
        if not await self.client.zrem(self.keys.coordinators(), coordinator_id):
            return  # another survivor claimed it
        sessions_key = self.keys.sessions(coordinator_id)
        session_ids = [s.decode() for s in await self.client.smembers(sessions_key)]
        await self.client.delete(sessions_key, self.keys.load(coordinator_id))
        if not session_ids:
            return
        log.warning("coordinator %s is gone: closing its %d sessions on the replicas", coordinator_id, len(session_ids))
        calls = [
            replica.stub.CloseSession(
                common_pb2.CloseSessionRequest(session_id=session_id), timeout=self.call_timeout_s
            )
            for session_id in session_ids
            for _, replica in self._replicas()
        ]
        results = await asyncio.gather(*calls, return_exceptions=True)
        failed = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
        if failed:
            log.warning(
                "closing sessions of coordinator %s: %d calls failed (%s)",
                coordinator_id,
                len(failed),
                failed[0].code().name,
            )

    async def run(self) -> None:
        """Refreshes every refresh_s until cancelled; Redis errors are logged once per outage."""
        while True:
            try:
                await self.refresh()
                if not self._redis_ok:
                    log.info("session registry: Redis is back")
                self._redis_ok = True
            except redis.exceptions.RedisError as error:
                if self._redis_ok:
                    log.warning(
                        "session registry: Redis unreachable (%s); placing by this coordinator's own "
                        "counts until it is back",
                        error,
                    )
                self._redis_ok = False
                for _, replica in self._replicas():
                    replica.remote_sessions = 0
            await asyncio.sleep(self.refresh_s)

    async def close(self) -> None:
        """Leaves the registry (clean shutdown: our sessions were closed by the drain)."""
        pipe = self.client.pipeline(transaction=False)
        pipe.zrem(self.keys.coordinators(), self.coordinator_id)
        pipe.delete(self.keys.load(self.coordinator_id), self.keys.sessions(self.coordinator_id))
        await self._best_effort("leave the registry", pipe.execute())
