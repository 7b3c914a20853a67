"""Replica discovery without model services: the address diff, and a pool following its targets (channels
to ports nothing listens on, never dialled)."""

from __future__ import annotations

import asyncio

import pytest

from coordinator.replica_discovery import ReplicaDiscovery, diff_addresses
from coordinator.replicas import Replica, ReplicaPool
from specdec.v1 import verifier_pb2_grpc


@pytest.mark.parametrize(
    "current, wanted, added, removed",
    [
        (["a:1", "b:1"], ["a:1", "b:1"], [], []),
        (["a:1"], ["a:1", "c:1", "b:1"], ["c:1", "b:1"], []),
        (["a:1", "b:1", "c:1"], ["b:1"], [], ["a:1", "c:1"]),
        (["a:1"], ["b:1"], ["b:1"], ["a:1"]),
        (["a:1"], ["a:2"], ["a:2"], ["a:1"]),  # same IP, another port: another replica
        ([], ["a:1"], ["a:1"], []),
    ],
)
def test_diff_says_which_addresses_joined_and_which_left(current, wanted, added, removed):
    assert diff_addresses(current, wanted) == (added, removed)


class ReadyAtOnce(ReplicaPool):
    """A pool whose replicas are ready without a server (Info as a refused check sees it)."""

    async def ready(self, replica: Replica, timeout_s: float) -> None:
        replica.info = None


def refuse(address: str):
    def check(replica: Replica) -> None:
        if replica.address == address:
            raise ValueError("token->id map differs")

    return check


async def settle(discovery: ReplicaDiscovery) -> None:
    await discovery.refresh()
    await asyncio.sleep(0.05)  # the joins run as tasks


def test_discovery_joins_new_addresses_retires_vanished_ones_and_skips_refused_ones():
    class Fixed:
        def __init__(self, *addresses: str):
            self.now = list(addresses)

        async def addresses(self) -> list[str]:
            return self.now

    async def scenario() -> None:
        pool = ReadyAtOnce("verify", ["127.0.0.1:1"], verifier_pb2_grpc.VerifierStub)
        changes = []
        pool.on_health_change = lambda: changes.append([r.address for r in pool.replicas])
        targets = Fixed("127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3")
        discovery = ReplicaDiscovery(pool, targets, 1.0, 1.0, refuse("127.0.0.1:3"))
        await settle(discovery)
        assert [r.address for r in pool.replicas] == ["127.0.0.1:1", "127.0.0.1:2"]
        assert changes == [["127.0.0.1:1", "127.0.0.1:2"]]  # the health follows the joins

        first = pool.replicas[0]
        targets.now = ["127.0.0.1:2", "127.0.0.1:3"]
        await settle(discovery)
        assert [r.address for r in pool.replicas] == ["127.0.0.1:2"]  # :3 refused, not tried again
        assert first.retired and changes[-1] == ["127.0.0.1:2"]

        targets.now = ["127.0.0.1:1", "127.0.0.1:2"]  # a retired address back in DNS: a fresh replica
        await settle(discovery)
        assert [r.address for r in pool.replicas] == ["127.0.0.1:2", "127.0.0.1:1"]
        assert pool.replicas[1] is not first and not pool.replicas[1].retired
        assert pool.acquire() is pool.replicas[0] and pool.acquire() is pool.replicas[1]

        targets.now = ["127.0.0.1:3"]  # the only address left is refused: the pool keeps a last replica
        await settle(discovery)
        assert [r.address for r in pool.replicas] in (["127.0.0.1:1"], ["127.0.0.1:2"])
        targets.now = ["127.0.0.1:4"]  # until a replacement has joined
        await settle(discovery)
        assert [r.address for r in pool.replicas] == ["127.0.0.1:4"]
        await discovery.stop()
        await pool.close()

    asyncio.run(scenario())
