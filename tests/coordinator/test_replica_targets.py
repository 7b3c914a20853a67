"""dns:/// replica entries: looked up on a loopback DNS server whose records the tests change, or by the system."""

from __future__ import annotations

import asyncio

import pytest
from loopback_dns import LoopbackDns

from coordinator.replica_targets import DnsResolver, ReplicaTargets, join_host_port, split_host_port
from specdec.common.errors import DownstreamUnavailableError


def test_host_port_forms():
    assert split_host_port("127.0.0.1:53") == ("127.0.0.1", 53)
    assert split_host_port("[::1]:5353") == ("::1", 5353)
    assert join_host_port("::1", 50062) == "[::1]:50062"
    assert join_host_port("10.1.2.3", 50062) == "10.1.2.3:50062"
    with pytest.raises(ValueError):
        split_host_port("no-port")


def test_targets_follow_the_records_and_a_failed_lookup_keeps_the_last_answer():
    with LoopbackDns() as server:
        server.set("verify.specdec.test", "127.0.0.2")
        resolver = DnsResolver(server.address)
        entries = ["dns:///verify.specdec.test:50062", "127.0.0.9:7", "dns:///127.0.0.3:50062"]
        targets = ReplicaTargets("verify", entries, resolver)

        async def scenario() -> None:
            assert targets.dynamic
            assert await targets.addresses() == ["127.0.0.2:50062", "127.0.0.9:7", "127.0.0.3:50062"]
            server.set("verify.specdec.test", "127.0.0.5", "127.0.0.4", "127.0.0.3")
            assert await targets.addresses() == ["127.0.0.3:50062", "127.0.0.4:50062", "127.0.0.5:50062", "127.0.0.9:7"]
            server.set("verify.specdec.test")  # no address at all: a hiccup, not "no replicas"
            assert await targets.addresses() == ["127.0.0.3:50062", "127.0.0.4:50062", "127.0.0.5:50062", "127.0.0.9:7"]
            server.records.pop("verify.specdec.test")  # NXDOMAIN: the same
            assert await targets.addresses() == ["127.0.0.3:50062", "127.0.0.4:50062", "127.0.0.5:50062", "127.0.0.9:7"]
            with pytest.raises(DownstreamUnavailableError, match="dns:///missing.specdec.test:1"):
                await ReplicaTargets("draft", ["dns:///missing.specdec.test:1"], resolver).addresses()
            assert not ReplicaTargets("draft", ["127.0.0.1:1"], resolver).dynamic

        asyncio.run(scenario())


def test_without_a_nameserver_the_system_resolver_answers_names_from_etc_hosts():
    targets = ReplicaTargets("draft", ["dns:///localhost:50061"], DnsResolver())
    addresses = asyncio.run(targets.addresses())
    assert addresses and set(addresses) <= {"127.0.0.1:50061", "[::1]:50061"}
