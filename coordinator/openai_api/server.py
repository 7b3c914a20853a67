"""Serving the HTTP front with uvicorn (httptools parser) on the running event loop, TLS as on the gRPC port."""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from typing import Protocol

import uvicorn
from starlette.applications import Starlette

from specdec.serving.tls import read_pem

log = logging.getLogger(__name__)


class HttpTls(Protocol):
    """The TLS settings of an HTTP port: the coordinator's (as for its gRPC port) or the front's own."""

    tls_cert: str
    tls_key: str
    tls_client_ca: str


def bound_socket(address: str) -> socket.socket:
    """A listening TCP socket on HOST:PORT ([::] and IPv6 hosts too; port 0 picks a free one).

    Its protocol is named (IPPROTO_TCP), as the sockets asyncio makes itself: asyncio turns Nagle's algorithm off
    only on connections of such a socket, and with it on, a stream's first chunk, written right after the headers,
    waited for the client's delayed ACK (40 ms of time to first token on loopback, uvloop aside)."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, int(port)))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


def tls_options(tls: HttpTls) -> dict:
    """uvicorn's TLS options from the same settings as a gRPC port's (mutual TLS with tls_client_ca)."""
    if not tls.tls_cert and not tls.tls_key:
        return {}
    if not (tls.tls_cert and tls.tls_key):
        raise ValueError("tls_cert and tls_key: give both or neither")
    for path, name in ((tls.tls_cert, "tls_cert"), (tls.tls_key, "tls_key")):
        read_pem(path, name)  # fails early, naming the setting
    options = {"ssl_certfile": tls.tls_cert, "ssl_keyfile": tls.tls_key}
    if tls.tls_client_ca:
        options |= {"ssl_ca_certs": tls.tls_client_ca, "ssl_cert_reqs": ssl.CERT_REQUIRED}
    return options


class HttpServer:
    """uvicorn serving an app on the current loop, beside whatever else the process serves."""

    def __init__(self, app: Starlette, address: str, tls: HttpTls, grace_s: float = 10.0):
        self.socket = bound_socket(address)
        self.port = self.socket.getsockname()[1]
        config = uvicorn.Config(
            app,
            http="httptools",
            lifespan="off",
            access_log=False,
            log_level="warning",
            timeout_graceful_shutdown=int(grace_s),
            **tls_options(tls),
        )
        config.load()
        self.server = uvicorn.Server(config)
        # what Server.serve sets up before startup; serve itself would take over the process's signal handlers
        self.server.lifespan = config.lifespan_class(config)
        self._ticks: asyncio.Task | None = None

    async def start(self) -> HttpServer:
        await self.server.startup(sockets=[self.socket])
        self._ticks = asyncio.ensure_future(self.server.main_loop())  # date header, exit flag
        return self

    async def stop(self) -> None:
        """Stops taking connections and gives those in flight the grace period."""
        self.server.should_exit = True
        if self._ticks is not None:
            await self._ticks
        await self.server.shutdown(sockets=[self.socket])
