"""A tiny authoritative DNS server on loopback UDP whose A records a test sets and changes while it runs."""

from __future__ import annotations

import socket
import threading

import dns.flags
import dns.message
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset


class LoopbackDns:
    """Answers A queries for the names in `records` (TTL 0), an empty answer for other types of those names,
    NXDOMAIN for any other name. Use as a context manager; `address` is its HOST:PORT."""

    def __init__(self) -> None:
        self.records: dict[str, list[str]] = {}
        self._lock = threading.Lock()
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._socket.bind(("127.0.0.1", 0))
        self._socket.settimeout(0.1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="loopback-dns", daemon=True)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self._socket.getsockname()[1]}"

    def set(self, name: str, *ips: str) -> None:
        """Makes `name` resolve to `ips` from the next query on."""
        with self._lock:
            self.records[name.rstrip(".").lower()] = list(ips)

    def __enter__(self) -> LoopbackDns:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._socket.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                data, client = self._socket.recvfrom(4096)
            except TimeoutError:
                continue
            self._socket.sendto(self._answer(dns.message.from_wire(data)).to_wire(), client)

    def _answer(self, query: dns.message.Message) -> dns.message.Message:
        response = dns.message.make_response(query)
        response.flags |= dns.flags.AA
        for question in query.question:
            with self._lock:
                ips = self.records.get(question.name.to_text(omit_final_dot=True).lower())
            if ips is None:
                response.set_rcode(dns.rcode.NXDOMAIN)
            elif question.rdtype == dns.rdatatype.A and ips:
                response.answer.append(dns.rrset.from_text_list(question.name, 0, dns.rdataclass.IN, "A", ips))
        return response
