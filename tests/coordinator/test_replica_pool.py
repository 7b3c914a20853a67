"""Replicas joining and retiring a pool while it serves, on fake channels: a retired replica's channel closes
once nothing uses it, and its health probe ends."""

from __future__ import annotations

import asyncio

import grpc

from coordinator import close_retry
from coordinator.close_retry import retry_close_later
from coordinator.replicas import Replica, ReplicaPool
from specdec.v1 import verifier_pb2_grpc


class FakeChannel:
    """Records calls (each refused as UNAVAILABLE) and closing; a call after closing fails the test (on a real
    channel it may hang or crash the process)."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.closed = False

    def unary_unary(self, method: str, *args, **kwargs):
        async def call(request, timeout=None):
            assert not self.closed, f"{method} called on a closed channel"
            self.calls.append(method)
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata())

        return call

    unary_stream = stream_unary = stream_stream = unary_unary

    async def close(self) -> None:
        self.closed = True


class FakeChannels(ReplicaPool):
    def open(self, address: str) -> Replica:
        channel = FakeChannel()
        return Replica(address, channel, verifier_pb2_grpc.VerifierStub(channel))


def test_a_retired_replica_closes_its_channel_once_unused_and_is_probed_no_more(monkeypatch):
    monkeypatch.setattr(close_retry, "CLOSE_RETRY_DELAY_S", 0.05)

    async def scenario() -> None:
        pool = FakeChannels("verify", ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"], None)
        busy, idle, closing = pool.replicas
        assert pool.acquire() is busy
        pool.mark_unhealthy(busy, probe_interval_s=0.02)  # a failed call: probed until healthy or retired
        await asyncio.sleep(0.1)
        assert busy.channel.calls  # probed
        retry_close_later(closing, "session-1", timeout_s=1.0)  # a close that failed, retried in 50 ms
        for replica in pool.replicas[:]:
            pool.retire(replica)
        probes = len(busy.channel.calls)
        await asyncio.sleep(0.02)
        assert idle.channel.closed and not busy.channel.closed and not closing.channel.closed
        pool.mark_unhealthy(idle)  # a late failure of a session there: a retired replica is not probed
        await asyncio.sleep(0.1)
        assert len(busy.channel.calls) == probes and not pool._tasks  # its probe ended
        assert closing.channel.calls == ["/specdec.v1.Verifier/CloseSession"] and closing.channel.closed
        assert not busy.channel.closed  # its session still runs
        pool.release(busy)
        await asyncio.sleep(0.01)
        assert busy.channel.closed
        assert not pool.any_healthy and pool.replicas == []

    asyncio.run(scenario())
