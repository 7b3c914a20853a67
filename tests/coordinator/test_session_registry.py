"""The session registry on a real redis-server: placement counts every coordinator's sessions, and a dead
coordinator's record is claimed and cleared by a survivor. (Closing the dead one's sessions on real replicas
is checked end to end in test_journal_resume.py.)"""

from __future__ import annotations

import asyncio

from coordinator.redis_state import RedisKeys, connect
from coordinator.replicas import ReplicaPool
from coordinator.session_registry import SessionRegistry
from specdec.v1 import verifier_pb2_grpc

ADDRESSES = ["127.0.0.1:1", "127.0.0.1:2"]  # never dialled except by the reaper (refused at once)


def test_placement_counts_other_coordinators_and_survivors_reap_the_dead(redis_server):
    async def scenario():
        client = connect(redis_server.url, 1.0)
        keys = RedisKeys("registry-test:")
        pools = {name: ReplicaPool("verify", ADDRESSES, verifier_pb2_grpc.VerifierStub) for name in "ab"}
        registries = {
            name: SessionRegistry(
                client, keys, f"coordinator-{name}", [pools[name]], ttl_s=1.0, refresh_s=0.1, call_timeout_s=0.5
            )
            for name in "ab"
        }
        pools["a"].replicas[0].active_sessions = 2  # coordinator a holds two sessions on the first replica
        await registries["a"].add("session-of-a")
        await registries["a"].refresh()
        await registries["b"].refresh()
        assert [r.remote_sessions for r in pools["b"].replicas] == [2, 0]
        assert pools["b"].acquire().address == ADDRESSES[1]  # alone, b would have picked the first
        await registries["b"].refresh()
        await registries["a"].refresh()
        assert [r.remote_sessions for r in pools["a"].replicas] == [0, 1]

        await asyncio.sleep(1.2)  # a stops refreshing: its heartbeat expires
        await registries["b"].refresh()
        assert await client.zscore(keys.coordinators(), "coordinator-a") is None
        assert not await client.exists(keys.sessions("coordinator-a"), keys.load("coordinator-a"))
        await registries["b"].refresh()
        assert [r.remote_sessions for r in pools["b"].replicas] == [0, 0]

        await registries["b"].close()
        assert await client.zcard(keys.coordinators()) == 0
        for pool in pools.values():
            await pool.close()
        await client.aclose()

    asyncio.run(scenario())
