"""Fixtures for the coordinator's Redis-backed features and TLS: real processes, a real redis-server.

One draft and one verify process serve every module that asks for `secure_replicas`; they speak mutual TLS
only, so each coordinator started here connects with the test CA and a client certificate.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import pathlib
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import pytest
from certs import Pki, make_pki

from coordinator.api_keys import add_key
from coordinator.redis_state import RedisKeys, connect_sync
from specdec.client import Client
from specdec.common.settings import flag_name
from specdec.local_stack import ServiceProcess, start_service
from specdec.redis_server import RedisServer, free_port
from specdec.v1 import common_pb2, drafter_pb2_grpc, verifier_pb2_grpc


def in_parallel(*starts: Callable[[], ServiceProcess]) -> list[ServiceProcess]:
    """Starts services concurrently (each start mostly waits for imports); stops the started ones on failure."""
    with concurrent.futures.ThreadPoolExecutor(len(starts)) as pool:
        futures = [pool.submit(start) for start in starts]
        concurrent.futures.wait(futures)
    failed = [f.exception() for f in futures if f.exception() is not None]
    if failed:
        for future in futures:
            if future.exception() is None:
                future.result().stop()
        raise failed[0]
    return [f.result() for f in futures]


def channel_credentials(pki: Pki, client=True) -> grpc.ChannelCredentials:
    key, cert = (pki.client.key.read_bytes(), pki.client.cert.read_bytes()) if client else (None, None)
    return grpc.ssl_channel_credentials(pki.ca.cert.read_bytes(), private_key=key, certificate_chain=cert)


@dataclass
class SecureReplicas:
    """A draft and a verify process that require client certificates from the test CA."""

    target: str
    draft: ServiceProcess
    verify: ServiceProcess
    pki: Pki
    log_dir: pathlib.Path
    health_ports: dict[str, int]  # the plaintext health-only port of "draft" and "verify"

    def coordinator_args(self, client_certificate: bool = True) -> list[str]:
        args = [
            "--tokenizer",
            self.target,
            "--draft-replicas",
            self.draft.address,
            "--verify-replicas",
            self.verify.address,
            "--replica-tls-ca",
            str(self.pki.ca.cert),
        ]
        if client_certificate:
            args += ["--replica-tls-cert", str(self.pki.client.cert), "--replica-tls-key", str(self.pki.client.key)]
        return args

    def start_coordinator(self, name: str, *args: str) -> ServiceProcess:
        return start_service(name, "coordinator", [*self.coordinator_args(), *args], self.log_dir)

    def active_sessions(self) -> tuple[int, int]:
        counts = []
        for service, stub_type in (
            (self.draft, drafter_pb2_grpc.DrafterStub),
            (self.verify, verifier_pb2_grpc.VerifierStub),
        ):
            with grpc.secure_channel(service.address, channel_credentials(self.pki)) as channel:
                counts.append(stub_type(channel).Info(common_pb2.InfoRequest(), timeout=10).active_sessions)
        return counts[0], counts[1]


@pytest.fixture(scope="session")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="session")
def secure_replicas(long_pair_dirs, pki, tmp_path_factory):
    target_dir, draft_dir = long_pair_dirs
    log_dir = tmp_path_factory.mktemp("secure_stack")
    tls = ["--tls-cert", str(pki.server.cert), "--tls-key", str(pki.server.key), "--tls-client-ca", str(pki.ca.cert)]
    health = {"draft": free_port(), "verify": free_port()}  # plaintext health-only ports, as in Kubernetes

    def start(name: str, module: str, model: pathlib.Path) -> ServiceProcess:
        args = ["--model", str(model), *tls, "--health-port", str(health[name])]
        return start_service(name, module, args, log_dir)

    draft, verify = in_parallel(
        lambda: start("draft", "draft_service", draft_dir), lambda: start("verify", "verify_service", target_dir)
    )
    yield SecureReplicas(str(target_dir), draft, verify, pki, log_dir, health)
    draft.stop()
    verify.stop()


@pytest.fixture(scope="module")
def redis_server():
    """A real redis-server of the module's own (on a free loopback port)."""
    with RedisServer() as server:
        yield server


@dataclass
class GuardedCoordinator:
    """A coordinator that requires API keys, with small limits, on its own redis-server."""

    redis: RedisServer
    service: ServiceProcess
    names: itertools.count

    @property
    def address(self) -> str:
        return self.service.address

    def add_key(self, requests_per_minute: int = 0, tokens_per_minute: int = 0) -> str:
        with connect_sync(self.redis.url) as client:
            return add_key(client, RedisKeys(), f"tenant-{next(self.names)}", requests_per_minute, tokens_per_minute)

    def client(self, api_key: str | None) -> Client:
        return Client(self.address, timeout_s=60, api_key=api_key)


GUARDED_LIMITS = {"max_new_tokens_limit": 16, "max_prompt_tokens": 48, "max_total_tokens": 56}


@pytest.fixture(scope="session")
def guarded(secure_replicas):
    with RedisServer() as redis:
        limits = [arg for name, value in GUARDED_LIMITS.items() for arg in (flag_name(name), str(value))]
        service = secure_replicas.start_coordinator(
            "coordinator-guarded", "--redis-url", redis.url, "--require-api-key", "--redis-timeout-s", "0.5", *limits
        )
        yield GuardedCoordinator(redis, service, itertools.count())
        service.stop()
