"""The addresses a --draft-replicas / --verify-replicas setting names: fixed entries as given, `dns:///NAME:PORT`
entries as one address per IP that NAME resolves to now (the system's resolver, or dnspython on a given
nameserver)."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Sequence

import dns.asyncresolver
import dns.exception

from specdec.common.errors import DownstreamUnavailableError

log = logging.getLogger(__name__)
DNS_PREFIX = "dns:///"


def split_host_port(address: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port` -> (host, port)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{address!r} is not HOST:PORT")
    return host.removeprefix("[").removesuffix("]"), int(port)


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class DnsResolver:
    """Looks a name up on the nameserver given as HOST:PORT (dnspython), else with the system's resolver
    (getaddrinfo: /etc/hosts, then /etc/resolv.conf with its search domains, so `localhost` and a Kubernetes
    Service's short name both work)."""

    def __init__(self, nameserver: str = "", timeout_s: float = 2.0):
        self.timeout_s = timeout_s
        self._resolver: dns.asyncresolver.Resolver | None = None
        if nameserver:
            host, port = split_host_port(nameserver)
            self._resolver = dns.asyncresolver.Resolver(configure=False)
            self._resolver.nameservers = [host]
            self._resolver.port = port
            self._resolver.lifetime = timeout_s

    async def ips(self, name: str) -> list[str]:
        """The name's IPs, sorted (an IP literal is its own answer); raises RESOLUTION_ERRORS."""
        try:
            return [str(ipaddress.ip_address(name))]
        except ValueError:
            pass
        if self._resolver is not None:
            answer = await self._resolver.resolve_name(name, search=True)
            return sorted(set(answer.addresses()))
        lookup = asyncio.get_running_loop().getaddrinfo(name, None, type=socket.SOCK_STREAM)
        infos = await asyncio.wait_for(lookup, self.timeout_s)
        return sorted({info[4][0] for info in infos})


RESOLUTION_ERRORS = (dns.exception.DNSException, OSError)  # OSError: socket.gaierror, TimeoutError


class ReplicaTargets:
    """One replica setting's entries. A name whose lookup fails (error, no such name, no address) keeps the
    addresses it had last, so a DNS hiccup never empties placement; before it ever resolved, the failure raises."""

    def __init__(self, kind: str, entries: Sequence[str], resolver: DnsResolver):
        self.kind = kind
        self.entries = list(entries)
        self.resolver = resolver
        self._last: dict[str, list[str]] = {}  # per dns:/// entry: the addresses of its last good lookup

    @property
    def dynamic(self) -> bool:
        """Whether any entry is a name whose addresses can change."""
        return any(entry.startswith(DNS_PREFIX) for entry in self.entries)

    async def addresses(self) -> list[str]:
        """Every address the entries name now, in entry order, each once."""
        addresses: list[str] = []
        for entry in self.entries:
            addresses.extend(await self._resolve(entry) if entry.startswith(DNS_PREFIX) else [entry])
        return list(dict.fromkeys(addresses))

    async def _resolve(self, entry: str) -> list[str]:
        host, port = split_host_port(entry.removeprefix(DNS_PREFIX))
        try:
            ips = await self.resolver.ips(host)
        except RESOLUTION_ERRORS as error:
            if entry not in self._last:
                raise DownstreamUnavailableError(f"{self.kind} replicas: resolving {entry} failed: {error}") from None
            log.warning("%s replicas: resolving %s failed (%s); keeping %s", self.kind, entry, error, self._last[entry])
            return self._last[entry]
        self._last[entry] = [join_host_port(ip, port) for ip in ips]
        return self._last[entry]
